// Memory read bandwidth: OpenMP threads sum their shares of a buffer far larger than the
// last-level cache, several passes with plain loads and as many with software prefetching
// (which streams faster on some CPUs), and the best pass is reported. A batch-1 decode step
// reads every weight once, so bytes per token ÷ this is the fastest a step can be;
// `infer bench` compiles and runs it (infer/bench/bandwidth.py) and compares W1's ITL with it.
//
//   g++ -O3 -march=native -fopenmp bench/membw.cpp -o /tmp/membw && /tmp/membw 1200 2 5
//
// Arguments: buffer MiB, threads, passes of each kind. Prints one line of JSON (GB/s: 1e9
// bytes a second; gb_s is the better kind's).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// One pass: the threads' sums of their static shares, reading each 64-byte line once, with a
// software prefetch of the line `ahead` bytes on (0: none; infer's kernels prefetch 16 KB on).
static uint64_t pass(const uint64_t* a, size_t lines, size_t ahead) {
  uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
  for (size_t line = 0; line < lines; ++line) {
    const uint64_t* p = a + line * 8;
    if (ahead) __builtin_prefetch(reinterpret_cast<const char*>(p) + ahead, 0, 2);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) sum += p[j];
  }
  return sum;
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1024;
  const int threads = argc > 2 ? atoi(argv[2]) : omp_get_max_threads();
  const int passes = argc > 3 ? atoi(argv[3]) : 5;
  const size_t lines = mib * (size_t{1} << 20) / 64;
  auto* a = static_cast<uint64_t*>(aligned_alloc(64, lines * 64));
  if (a == nullptr || lines == 0 || threads < 1 || passes < 1) {
    fprintf(stderr, "usage: membw MiB threads passes\n");
    return 2;
  }
  omp_set_num_threads(threads);
  // Written with the schedule the passes read with: each page is first touched (placed) by
  // the thread that reads it.
#pragma omp parallel for schedule(static)
  for (size_t line = 0; line < lines; ++line)
    for (size_t j = 0; j < 8; ++j) a[line * 8 + j] = line + j;
  // Plain loads, then with prefetching; each kind's best pass (the passes alternate).
  double best[2] = {1e30, 1e30};
  uint64_t check = 0;
  for (int p = 0; p < 2 * passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    check += pass(a, lines, p % 2 ? 16384 : 0);  // printed, so no pass can be left out
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best[p % 2] = std::min(best[p % 2], dt.count());
  }
  const double bytes = static_cast<double>(lines * 64);
  const double plain = bytes / best[0] / 1e9, prefetched = bytes / best[1] / 1e9;
  printf(
      "{\"gb_s\": %.3f, \"plain_gb_s\": %.3f, \"prefetch_gb_s\": %.3f, \"bytes\": %.0f, "
      "\"threads\": %d, \"passes\": %d, \"check\": %llu}\n",
      std::max(plain, prefetched), plain, prefetched, bytes, threads, passes,
      static_cast<unsigned long long>(check));
  free(a);
  return 0;
}
