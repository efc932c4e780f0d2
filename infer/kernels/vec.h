// Scalar helpers written so that `#pragma omp simd` loops over them vectorize.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFER_AMX 1
#include <initializer_list>
#include <utility>

// Load a tile configuration: tile i gets shapes[i] = (rows, bytes per row); palette 1.
inline void configure_tiles(std::initializer_list<std::pair<int, int>> shapes) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  int t = 0;
  for (const auto& [rows, bytes] : shapes) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t++] = static_cast<uint16_t>(bytes);
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration, which
  // lets it drop the stores of the shapes: make them all happen first.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// bf16 is the top half of a float: widen with a shift the compiler vectorizes.
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// float -> T, rounding to nearest even. For bf16 this is c10's rounding written without
// branches (NaN by a select), so that loops over it vectorize; c10's conversion does not.
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  return out;
}

// e^x (relative error ~2e-7): 2^t split into the nearest integer and a fraction in
// [-0.5, 0.5], the fraction by its degree-6 Taylor polynomial. std::exp stays scalar without
// -ffast-math, which would change the process's floating-point mode.
inline float fast_exp(float x) {
  const float t = std::min(std::max(x, -87.f), 88.f) * 1.44269504088896341f;
  const float whole = std::floor(t + 0.5f);
  const float f = t - whole;
  const float p =
      1.f + f * (0.693147182f +
                 f * (0.240226507f +
                      f * (0.0555041087f +
                           f * (0.00961812911f + f * (0.00133335581f + f * 0.000154035304f)))));
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// The first min(left, 16) of 16 lanes: a loop's tail mask.
inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// fast_exp on 16 lanes, the same steps.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(
      _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f)),
      _mm512_set1_ps(1.44269504088896341f));
  const __m512 whole = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)),
                                            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(0.000154035304f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00133335581f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00961812911f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240226507f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147182f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// The gate activations on 16 lanes: SiLU x / (1 + e^-x), and GELU's tanh form
// 0.5x(1 + tanh y), y = sqrt(2/pi)(x + 0.044715x^3), with tanh y = 1 - 2 / (e^2y + 1).
inline __m512 silu16(__m512 x) {
  return _mm512_div_ps(
      x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

inline __m512 gelu_tanh16(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  const __m512 e = exp16(_mm512_add_ps(y, y));
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                       _mm512_sub_ps(_mm512_set1_ps(2.f), t));
}

// GELU's erf form 0.5x(1 + erf(x / sqrt 2)) on 16 lanes (BERT's), erf by Abramowitz and
// Stegun 7.1.26 (absolute error under 1.5e-7; torch's vectorized erf takes the same steps).
inline __m512 gelu_erf16(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.7071067811865476f));
  const __m512 a = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a,
                                                 _mm512_set1_ps(1.f)));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(a, a)));
  const __m512 erf_abs = _mm512_fnmadd_ps(_mm512_mul_ps(p, t), e, _mm512_set1_ps(1.f));
  // erf's sign is z's (integer ops: AVX512F alone has no float and/or)
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MIN));
  const __m512 erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(erf_abs), sign));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                       _mm512_add_ps(_mm512_set1_ps(1.f), erf));
}

// n bf16 values (masked) widened to float.
inline __m512 load_bf16(const void* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp16, silu16 and gelu_tanh16 on 8 lanes: the same operations, so the same bits.
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(
      _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f)),
      _mm256_set1_ps(1.44269504088896341f));
  const __m256 whole = _mm256_round_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)),
                                       _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, whole);
  __m256 p = _mm256_set1_ps(0.000154035304f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00133335581f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00961812911f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0555041087f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.240226507f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.693147182f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(whole), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(
      x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline __m256 gelu_tanh8(__m256 x) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  const __m256 e = exp8(_mm256_add_ps(y, y));
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                       _mm256_sub_ps(_mm256_set1_ps(2.f), t));
}
#endif

// The index of a row's largest value, the first one on ties; a NaN counts as the largest
// (torch.argmax's rule), so the first NaN wins.
inline int64_t row_argmax(const float* x, int64_t n) {
  bool nan = false;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 tail = lanes(n - i);
    const __m512 v = _mm512_mask_loadu_ps(m, tail, x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  nan = unordered != 0;
  best = _mm512_reduce_max_ps(m);
#else
  for (int64_t i = 0; i < n; ++i) {
    nan |= std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == best) return i;
  return 0;  // every value is -inf
}

// The largest of n floats. GCC leaves a float max reduction scalar even under `omp simd`
// (it was a quarter of the prefill attention kernel's time).
inline float row_max(const float* x, int64_t n) {
#if defined(__AVX512F__)
  // Four running maxima: one would wait on vmaxps's latency at every step.
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + i + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(x + i + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(x + i + 48));
  }
  m = _mm512_max_ps(_mm512_max_ps(m, m1), _mm512_max_ps(m2, m3));
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  if (i < n) {
    const __mmask16 tail = lanes(n - i);
    m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, x + i));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

// x[lo, hi) replaced by exp(x - max x), in float; returns their sum.
inline float exp_less_max(float* x, int64_t lo, int64_t hi) {
  const float mx = row_max(x + lo, hi - lo);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = lo; t < hi; ++t) {
    x[t] = fast_exp(x[t] - mx);
    sum += x[t];
  }
  return sum;
}

// Softmax of x[lo, hi) in place, exact in float; x[begin, lo) and x[hi, end) are zeroed.
inline void softmax_float(float* x, int64_t begin, int64_t lo, int64_t hi, int64_t end) {
  const float inv = 1.f / exp_less_max(x, lo, hi);
#pragma omp simd
  for (int64_t t = lo; t < hi; ++t) x[t] *= inv;
  for (int64_t t = begin; t < lo; ++t) x[t] = 0.f;
  for (int64_t t = hi; t < end; ++t) x[t] = 0.f;
}

// Softmax of x[lo, hi), exact in float (x keeps the exponentials), written to p[lo, hi) as
// bf16 bits for a VDPBF16PS P.V; p[begin, lo) and p[hi, end) are zeroed.
inline void softmax_bf16(float* x, uint16_t* p, int64_t begin, int64_t lo, int64_t hi,
                         int64_t end) {
  const float inv = 1.f / exp_less_max(x, lo, hi);
  for (int64_t t = begin; t < lo; ++t) p[t] = 0;
#pragma omp simd
  for (int64_t t = lo; t < hi; ++t) p[t] = from_float<c10::BFloat16>(x[t] * inv).x;
  for (int64_t t = hi; t < end; ++t) p[t] = 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The attention kernels' softmax (paged_prefill_attention, encoder_attention).
// e^x for x <= 0 as P needs it: rounded to bf16 right after, so 2^t, t = x log2(e), is its
// nearest integer (applied by scalef, which also takes very negative t to 0) times a degree-4
// polynomial of the fraction in [-0.5, 0.5] (relative error under 6e-5, a seventieth of bf16's
// rounding step). t comes in already scaled.
inline __m512 exp2_for_bf16(__m512 t) {
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(0.00961812911f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240226507f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147182f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, whole);
}

// One score row: p[t] = bf16(e^((x[t] - max) scale)) for t in [lo, hi), the max taken there,
// and 0 for t in [begin, lo) and [hi, end). Returns the sum of the exponentials.
inline float exp_row(const float* x, uint16_t* p, int64_t begin, int64_t lo, int64_t hi,
                     int64_t end, float scale) {
  const float c = scale * 1.44269504088896341f;  // e^(s scale) = 2^(s c)
  const __m512 vc = _mm512_set1_ps(c), shift = _mm512_set1_ps(row_max(x + lo, hi - lo) * c);
  __m512 sum = _mm512_setzero_ps();
  std::memset(p + begin, 0, (lo - begin) * sizeof(uint16_t));
  for (int64_t t = lo; t < hi; t += 16) {
    const __mmask16 mask = lanes(hi - t);
    const __m512 e = _mm512_maskz_mov_ps(
        mask, exp2_for_bf16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, x + t), vc, shift)));
    sum = _mm512_add_ps(sum, e);
    _mm256_mask_storeu_epi16(p + t, mask, (__m256i)_mm512_cvtneps_pbh(e));
  }
  std::memset(p + hi, 0, (end - hi) * sizeof(uint16_t));
  return _mm512_reduce_add_ps(sum);
}
#endif

// Run fn(begin, end) over [0, n) on every OpenMP thread, each taking the next `chunk` as it
// finishes one. The two cores are shared with the event loop and the clients: a static split
// makes the whole call wait for a thread the OS has taken away, while here the other thread
// takes over its remaining chunks.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk))
      fn(b, std::min(n, b + chunk));
  });
}

// Run fn(i, next) for every i in [0, n) on every OpenMP thread. Each thread owns a contiguous
// share and takes its items in order, so ``next`` (the item it will most likely run after i,
// or -1) is known and its data can be prefetched while i runs; a thread that finishes its
// share takes items from the back of the others' (for the same reason as parallel_chunks).
template <typename F>
inline void parallel_owned(int64_t n, const F& fn) {
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t{1} << 32), "parallel_owned: too many items");
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  struct alignas(64) Share {
    std::atomic<uint64_t> span;  // front in the low 32 bits, back (exclusive) in the high
  };
  auto pack = [](uint64_t front, uint64_t back) { return front | back << 32; };
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].span.store(pack(t * n / threads, (t + 1) * n / threads));
  // Take the front (owner) or the back (thief) item of share t; -1 when it is empty.
  auto take = [&](int64_t t, bool front, int64_t* next) -> int64_t {
    uint64_t span = shares[t].span.load();
    for (;;) {
      const uint64_t f = span & 0xFFFFFFFFu, b = span >> 32;
      if (f >= b) return -1;
      const uint64_t taken = front ? pack(f + 1, b) : pack(f, b - 1);
      if (shares[t].span.compare_exchange_weak(span, taken)) {
        const int64_t i = static_cast<int64_t>(front ? f : b - 1);
        *next = f + 1 < b ? (front ? i + 1 : i - 1) : -1;
        return i;
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t next;
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = take(t, true, &next); i >= 0; i = take(t, true, &next)) fn(i, next);
    for (int64_t k = 1; k < threads; ++k) {
      const int64_t victim = (t0 + k) % threads;
      for (int64_t i = take(victim, false, &next); i >= 0; i = take(victim, false, &next))
        fn(i, next);
    }
  });
}

// parallel_chunks with chunks of about an eighth of each thread's share.
template <typename F>
inline void parallel_eighths(int64_t n, const F& fn) {
  parallel_chunks(n, std::max<int64_t>(1, n / (8 * at::get_num_threads())), fn);
}

// Run fn(begin, end) over [0, n): in this thread when the work is small, since waking the
// second OpenMP thread (OMP_WAIT_POLICY=PASSIVE) costs tens of microseconds; else in
// parallel_eighths.
template <typename F>
inline void for_range(int64_t n, int64_t work, const F& fn) {
  constexpr int64_t kSerialWork = 1 << 17;
  if (work < kSerialWork || n < 2) {
    fn(0, n);
  } else {
    parallel_eighths(n, fn);
  }
}
