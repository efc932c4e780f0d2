// The int8 dot-product peaks of this CPU, per instruction set the quantized linears use:
// independent chains of 512-bit VPDPBUSD (AVX512-VNNI), 256-bit VPDPBUSD (AVX-VNNI), and
// VPMADDUBSW + VPMADDWD + VPADDD (AVX2), each on every thread, nothing loaded from memory.
// The kernels' batched rates are compared with them in bench/results/LOG.md.
//
//   g++ -O2 -march=native -pthread bench/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak 2
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

constexpr int kChains = 16;
constexpr long kRounds = 90000000L;  // per thread

#if defined(__AVX512VNNI__)
static int avx512_vnni() {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  __m512i c[kChains];
  for (int j = 0; j < kChains; ++j) {
    c[j] = _mm512_set1_epi32(j);
    asm volatile("" : "+v"(c[j]));  // distinct chains: the compiler may not merge them
  }
  for (long i = 0; i < kRounds; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) c[j] = _mm512_dpbusd_epi32(c[j], a, b);
  }
  __m512i s = c[0];
  for (int j = 1; j < kChains; ++j) s = _mm512_add_epi32(s, c[j]);
  return _mm512_reduce_add_epi32(s);
}
#endif

#if defined(__AVX2__)
// 256 bits: VPDPBUSD where AVX-VNNI exists, else the AVX2 sequence. Each chain feeds its own
// sum back as the u8 operand, so no product is shared between chains or hoisted.
template <bool Vnni>
static int avx256() {
  const __m256i b = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
  __m256i c[kChains];
  for (int j = 0; j < kChains; ++j) {
    c[j] = _mm256_set1_epi32(j);
    asm volatile("" : "+v"(c[j]));
  }
  for (long i = 0; i < kRounds; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) {
#if defined(__AVXVNNI__)
      if constexpr (Vnni) {
        c[j] = _mm256_dpbusd_avx_epi32(c[j], c[j], b);
        continue;
      }
#endif
      c[j] = _mm256_add_epi32(c[j], _mm256_madd_epi16(_mm256_maddubs_epi16(c[j], b), ones));
    }
  }
  __m256i s = c[0];
  for (int j = 1; j < kChains; ++j) s = _mm256_add_epi32(s, c[j]);
  return _mm256_extract_epi32(s, 0);
}
#endif

static void measure(const char* name, int lanes_bytes, int threads, const std::function<int()>& fn) {
  std::vector<std::thread> pool;
  std::vector<int> sink(threads);
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[t] = fn(); });
  for (auto& t : pool) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double macs = double(kChains) * lanes_bytes * kRounds * threads;
  printf("%s, %d thread(s): %.0f G int8 multiply-adds/s\n", name, threads, macs / s / 1e9);
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
#if defined(__AVX512VNNI__)
  measure("AVX512-VNNI vpdpbusd zmm", 64, threads, avx512_vnni);
#endif
#if defined(__AVXVNNI__)
  measure("AVX-VNNI vpdpbusd ymm", 32, threads, avx256<true>);
#endif
#if defined(__AVX2__)
  measure("AVX2 vpmaddubsw+vpmaddwd ymm", 32, threads, avx256<false>);
#endif
}
