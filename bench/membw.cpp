// Memory read bandwidth: OpenMP threads sum their shares of a buffer far larger than the
// last-level cache, several passes, and the best pass is reported. A batch-1 decode step reads
// every weight once, so bytes per token ÷ this is the fastest a step can be; `infer bench`
// compiles and runs it (infer/bench/bandwidth.py) and compares W1's ITL with it.
//
//   g++ -O3 -march=native -fopenmp bench/membw.cpp -o /tmp/membw && /tmp/membw 1200 2 5
//
// Arguments: buffer MiB, threads, passes. Prints one line of JSON (GB/s: 1e9 bytes a second).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1024;
  const int threads = argc > 2 ? atoi(argv[2]) : omp_get_max_threads();
  const int passes = argc > 3 ? atoi(argv[3]) : 5;
  const size_t n = mib * (size_t{1} << 20) / sizeof(uint64_t);
  auto* a = static_cast<uint64_t*>(aligned_alloc(64, n * sizeof(uint64_t)));
  if (a == nullptr || n == 0 || threads < 1 || passes < 1) {
    fprintf(stderr, "usage: membw MiB threads passes\n");
    return 2;
  }
  omp_set_num_threads(threads);
  // Written with the schedule the passes read with: each page is first touched (placed) by
  // the thread that reads it.
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) a[i] = i;
  double best = 1e30;
  uint64_t check = 0;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (size_t i = 0; i < n; ++i) sum += a[i];
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count());
    check ^= sum;  // printed, so the sums cannot be left out
  }
  const double bytes = static_cast<double>(n * sizeof(uint64_t));
  printf("{\"gb_s\": %.3f, \"bytes\": %.0f, \"threads\": %d, \"passes\": %d, \"check\": %llu}\n",
         bytes / best / 1e9, bytes, threads, passes, static_cast<unsigned long long>(check));
  free(a);
  return 0;
}
