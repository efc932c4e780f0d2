// The int8 dot-product peaks of this CPU, per instruction set the quantized linears use:
// independent chains of 512-bit VPDPBUSD (AVX512-VNNI), 256-bit VPDPBUSD (AVX-VNNI), and
// VPMADDUBSW + VPMADDWD + VPADDD (AVX2, and VPMADDUBSW + VPADDW where a tile sums in int16),
// each on every thread, nothing loaded from memory.
// The kernels' batched rates are compared with them in bench/results/LOG.md.
//
//   g++ -O2 -march=native -pthread bench/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak 2
//
// Each loop is written in assembly, counter and branch included, so that the loop holds only
// the instructions measured. Written with intrinsics over an array of chains, GCC kept the
// chains in other registers than the ones it multiplied into and copied them back every round
// (two register moves per VPDPBUSD), and on a Zen 5 that halved the figure.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

constexpr long kRounds = 100000000L;  // per thread

// VPDPBUSD into twelve chains (%0-%11) from %13 and %14, %12 counting the rounds down. Twelve
// chains cover a latency of 4-6 cycles at two a cycle; 256-bit VEX code has 16 registers.
#define DP(ins, j) ins " %14, %13, %" #j "\n\t"
#define DP12(ins)                                                                                  \
  "1:\n\t" DP(ins, 0) DP(ins, 1) DP(ins, 2) DP(ins, 3) DP(ins, 4) DP(ins, 5) DP(ins, 6) DP(ins, 7) \
      DP(ins, 8) DP(ins, 9) DP(ins, 10) DP(ins, 11) "dec %12\n\tjnz 1b\n\t"
#define CHAINS12(r)                                                                              \
  "+" r(c[0]), "+" r(c[1]), "+" r(c[2]), "+" r(c[3]), "+" r(c[4]), "+" r(c[5]), "+" r(c[6]), \
      "+" r(c[7]), "+" r(c[8]), "+" r(c[9]), "+" r(c[10]), "+" r(c[11])
constexpr int kDpChains = 12;

template <class V>
static int lane0_sum(const V* c, int n) {
  int s = 0;
  for (int j = 0; j < n; ++j) s += reinterpret_cast<const int*>(&c[j])[0];
  return s;
}

#if defined(__AVX512VNNI__)
static int avx512_vnni() {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), c[kDpChains];
  for (int j = 0; j < kDpChains; ++j) c[j] = _mm512_set1_epi32(j);
  long n = kRounds;
  asm volatile(DP12("vpdpbusd") : CHAINS12("v"), "+r"(n) : "v"(a), "v"(b));
  return lane0_sum(c, kDpChains);
}
#endif

#if defined(__AVXVNNI__)
static int avx_vnni() {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), c[kDpChains];
  for (int j = 0; j < kDpChains; ++j) c[j] = _mm256_set1_epi32(j);
  long n = kRounds;
  asm volatile(DP12("%{vex%} vpdpbusd") : CHAINS12("x"), "+r"(n) : "x"(a), "x"(b));
  return lane0_sum(c, kDpChains);
}
#endif

#if defined(__AVX2__)
// Eight chains, each c += VPMADDWD(VPMADDUBSW(c, b), ones) through one of four temporaries.
#define MADD(j, t) \
  "vpmaddubsw %13, %" #j ", %" #t "\n\tvpmaddwd %14, %" #t ", %" #t "\n\tvpaddd %" #t ", %" #j ", %" #j "\n\t"
static int avx2() {
  __m256i b = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1), c[8], t[4];
  for (int j = 0; j < 8; ++j) c[j] = _mm256_set1_epi32(j);
  long n = kRounds;
  asm volatile("1:\n\t" MADD(0, 9) MADD(1, 10) MADD(2, 11) MADD(3, 12) MADD(4, 9) MADD(5, 10)
                   MADD(6, 11) MADD(7, 12) "dec %8\n\tjnz 1b\n\t"
               : "+x"(c[0]), "+x"(c[1]), "+x"(c[2]), "+x"(c[3]), "+x"(c[4]), "+x"(c[5]), "+x"(c[6]),
                 "+x"(c[7]), "+r"(n), "=&x"(t[0]), "=&x"(t[1]), "=&x"(t[2]), "=&x"(t[3])
               : "x"(b), "x"(ones));
  return lane0_sum(c, 8);
}

// The same products summed in int16: c += VPMADDUBSW(a, b) by VPADDW, as the AVX2 tiles add
// a 4-bit group's pair sums before one VPMADDWD: the ceiling of those tiles.
#define MADD16(j, t) "vpmaddubsw %13, %14, %" #t "\n\tvpaddw %" #t ", %" #j ", %" #j "\n\t"
static int avx2_int16() {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), c[8], t[4];
  for (int j = 0; j < 8; ++j) c[j] = _mm256_set1_epi32(j);
  long n = kRounds;
  asm volatile("1:\n\t" MADD16(0, 9) MADD16(1, 10) MADD16(2, 11) MADD16(3, 12) MADD16(4, 9)
                   MADD16(5, 10) MADD16(6, 11) MADD16(7, 12) "dec %8\n\tjnz 1b\n\t"
               : "+x"(c[0]), "+x"(c[1]), "+x"(c[2]), "+x"(c[3]), "+x"(c[4]), "+x"(c[5]), "+x"(c[6]),
                 "+x"(c[7]), "+r"(n), "=&x"(t[0]), "=&x"(t[1]), "=&x"(t[2]), "=&x"(t[3])
               : "x"(b), "x"(a));
  return lane0_sum(c, 8);
}
#endif

static void measure(const char* name, long macs_per_round, int threads, const std::function<int()>& fn) {
  std::vector<std::thread> pool;
  std::vector<int> sink(threads);
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[t] = fn(); });
  for (auto& t : pool) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double macs = double(macs_per_round) * kRounds * threads;
  printf("%s, %d thread(s): %.0f G int8 multiply-adds/s\n", name, threads, macs / s / 1e9);
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
#if defined(__AVX512VNNI__)
  measure("AVX512-VNNI vpdpbusd zmm", kDpChains * 64, threads, avx512_vnni);
#endif
#if defined(__AVXVNNI__)
  measure("AVX-VNNI vpdpbusd ymm", kDpChains * 32, threads, avx_vnni);
#endif
#if defined(__AVX2__)
  measure("AVX2 vpmaddubsw+vpmaddwd ymm", 8 * 32, threads, avx2);
  measure("AVX2 vpmaddubsw+vpaddw ymm (int16 sums)", 8 * 32, threads, avx2_int16);
#endif
}
