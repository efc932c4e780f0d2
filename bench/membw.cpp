// Memory read bandwidth: OpenMP threads sum their shares of a buffer far larger than the
// last-level cache, several passes of each kind, and the best pass is reported. The kinds:
// plain loads; the same with software prefetching (which streams faster on some CPUs); and
// four streams per thread (its share's quarters read side by side, prefetched), which keeps
// more misses in flight: on this VM it read 11% more than one prefetched stream in the same
// minutes. A batch-1 decode step reads every weight once, so bytes per token ÷ this is
// the fastest a step can be; `infer bench` compiles and runs it (infer/bench/bandwidth.py)
// and compares W1's ITL with it.
//
//   g++ -O3 -march=native -fopenmp bench/membw.cpp -o /tmp/membw && /tmp/membw 1200 2 5
//
// Arguments: buffer MiB, threads, passes of each kind. Prints one line of JSON (GB/s: 1e9
// bytes a second; gb_s is the best kind's).
//
// The buffer is on 2 MB pages where Linux gives them (transparent huge pages, asked for with
// madvise), as infer's packed weights are (infer/models/huge_pages.py): on 4 KB pages the plain
// pass read 13-15% less on a Zen 5, the best kind 3-5% less.
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// One pass: the threads' sums of their static shares, reading each 64-byte line once, in
// `streams` side-by-side parts of each share, with a software prefetch of the line `ahead`
// bytes on (0: none; infer's kernels prefetch 16 KB on).
// A line's eight words add into eight sums (one vector add where the CPU has 512-bit ones):
// one scalar sum was slower than the memory on this VM's slow minutes.
static uint64_t pass(const uint64_t* a, size_t lines, size_t ahead, int streams) {
  uint64_t sum = 0;
#pragma omp parallel reduction(+ : sum)
  {
    const size_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const size_t first = lines * t / nt, part = (lines * (t + 1) / nt - first) / streams;
    alignas(64) uint64_t lanes[8] = {};
    for (size_t i = 0; i < part; ++i)
      for (int st = 0; st < streams; ++st) {
        const uint64_t* p = a + (first + st * part + i) * 8;
        if (ahead) __builtin_prefetch(reinterpret_cast<const char*>(p) + ahead, 0, 2);
#pragma omp simd
        for (int j = 0; j < 8; ++j) lanes[j] += p[j];
      }
    for (int j = 0; j < 8; ++j) sum += lanes[j];
  }
  return sum;
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1024;
  const int threads = argc > 2 ? atoi(argv[2]) : omp_get_max_threads();
  const int passes = argc > 3 ? atoi(argv[3]) : 5;
  const size_t lines = mib * (size_t{1} << 20) / 64;
  constexpr size_t kHuge = size_t{1} << 21;
  const size_t bytes = (lines * 64 + kHuge - 1) / kHuge * kHuge;
  auto* a = static_cast<uint64_t*>(aligned_alloc(kHuge, bytes));
  if (a == nullptr || lines == 0 || threads < 1 || passes < 1) {
    fprintf(stderr, "usage: membw MiB threads passes\n");
    return 2;
  }
  madvise(a, bytes, MADV_HUGEPAGE);  // before the first touch; where it fails, 4 KB pages
  omp_set_num_threads(threads);
  // Written with the schedule the passes read with: each page is first touched (placed) by
  // the thread that reads it.
#pragma omp parallel for schedule(static)
  for (size_t line = 0; line < lines; ++line)
    for (size_t j = 0; j < 8; ++j) a[line * 8 + j] = line + j;
  // The kinds take turns pass by pass; each kind's best pass.
  constexpr int kKinds = 3;
  const size_t ahead[kKinds] = {0, 16384, 4096};
  const int streams[kKinds] = {1, 1, 4};
  double best[kKinds] = {1e30, 1e30, 1e30};
  uint64_t check = 0;
  for (int p = 0; p < kKinds * passes; ++p) {
    const int kind = p % kKinds;
    const auto t0 = std::chrono::steady_clock::now();
    check += pass(a, lines, ahead[kind], streams[kind]);  // printed: no pass can be left out
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best[kind] = std::min(best[kind], dt.count());
  }
  // the lines the passes read (a share's last few lines are left out when it does not split
  // into `streams` equal parts: at most 3 a thread, counted out here)
  double gbs[kKinds];
  for (int k = 0; k < kKinds; ++k) {
    size_t read = 0;
    for (int t = 0; t < threads; ++t)
      read += (lines * (t + 1) / threads - lines * t / threads) / streams[k] * streams[k];
    gbs[k] = static_cast<double>(read * 64) / best[k] / 1e9;
  }
  printf(
      "{\"gb_s\": %.3f, \"plain_gb_s\": %.3f, \"prefetch_gb_s\": %.3f, \"streams_gb_s\": %.3f, "
      "\"bytes\": %.0f, \"threads\": %d, \"passes\": %d, \"check\": %llu}\n",
      std::max({gbs[0], gbs[1], gbs[2]}), gbs[0], gbs[1], gbs[2], static_cast<double>(lines * 64),
      threads, passes, static_cast<unsigned long long>(check));
  free(a);
  return 0;
}
