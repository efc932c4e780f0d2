// The int8 dot-product peak of this CPU: independent chains of 512-bit VPDPBUSD (64 u8 x s8
// multiply-adds each) per thread, nothing loaded from memory. The quantized linears' batched
// rate is compared with it in bench/results/LOG.md.
//
//   g++ -O2 -march=native -pthread bench/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak 2
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

template <int N>
static int chains(long iters) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  __m512i c[N];
  for (int j = 0; j < N; ++j) {
    c[j] = _mm512_set1_epi32(j);
    asm volatile("" : "+v"(c[j]));  // distinct chains: the compiler may not merge them
  }
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) c[j] = _mm512_dpbusd_epi32(c[j], a, b);
  }
  __m512i s = c[0];
  for (int j = 1; j < N; ++j) s = _mm512_add_epi32(s, c[j]);
  return _mm512_reduce_add_epi32(s);
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  const long macs_per_thread = 48L * 64 * 30000000;  // 48 instructions x 30 M rounds
  for (int n : {8, 16}) {
    std::vector<std::thread> pool;
    std::vector<int> sink(threads);
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { sink[t] = n == 8 ? chains<8>(6 * 30000000L) : chains<16>(3 * 30000000L); });
    for (auto& t : pool) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%d thread(s), %d chains: %.0f G int8 multiply-adds/s\n", threads, n,
           macs_per_thread * threads / s / 1e9);
  }
}
