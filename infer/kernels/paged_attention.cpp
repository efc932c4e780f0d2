// Paged attention for decode on CPU: one query token per sequence, keys and values read
// straight from the block pool through each sequence's block table.
//
// Layouts (per layer, see PagedKVCache and cache_strides): keys [blocks, kv_heads, head_dim / 2,
// block, 2] and values [blocks, kv_heads, block / 2, head_dim, 2]. With AVX512-BF16 and
// 16-position blocks, one VDPBF16PS scores a query against a block's 16 positions two
// dimensions at a time (no horizontal sums), and one adds two positions' weighted values (P
// rounded to bf16, as the prefill kernel and torch's flash kernel do): a third of the
// instructions of widening bf16 to float and FMA-ing. On AVX2, bf16 caches have their own
// FMA loop; elsewhere a generic loop computes the same in float. Each (sequence, KV head)
// reads its own blocks from memory once, for its own length, for every query head of its
// group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

struct Shape {
  int64_t n_seqs, n_heads, n_kv, groups, dim, block, max_blocks, q_stride, window;
  float scale;
  CacheStrides at;  // where each (block, head) slab of the caches starts
};

// Ask for a block before it is used: a sequence's blocks are scattered over the pool, so the
// hardware prefetcher cannot guess them. Into L2 (prefetcht1), two blocks ahead: L2 keeps
// more misses in flight than L1 (figures in bench/results/LOG.md).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// The lines of one head's blocks [from, to) (kLines a block, kBlocks blocks at most), asked
// for a few at a time between other work, so that their reads overlap it rather than stall
// it in one burst: fetch(n) brings the next n, up to line `end` (every line unless set).
template <int64_t kBlocks, int64_t kLines>
struct BlockLines {
  const char* block[kBlocks];
  int64_t lines, line = 0, end;
  BlockLines(const Shape& s, const uint16_t* cache, const int32_t* table, int64_t h,
             int64_t from, int64_t to)
      : lines((to - from) * kLines), end(lines) {
    for (int64_t b = from; b < to; ++b)
      block[b - from] = reinterpret_cast<const char*>(cache + s.at.of(table[b], h));
  }
  void fetch(int64_t n) {
    for (; n > 0 && line < end; --n, ++line)
      __builtin_prefetch(block[line / kLines] + line % kLines * 64, 0, 2);  // into L2
  }
};

// Query heads of one KV head per pass over its keys and values: every head of the groups
// models have (2 to 8), so that each block is read from memory once.
constexpr int64_t kGroupMax = 8;

// f(std::integral_constant<int64_t, n>{}) for n in [1, kGroupMax]: the heads of a pass as a
// compile-time count (their accumulators are arrays in registers).
template <typename F>
inline void with_heads(int64_t n, const F& f) {
  switch (n) {
    case 8: return f(std::integral_constant<int64_t, 8>{});
    case 7: return f(std::integral_constant<int64_t, 7>{});
    case 6: return f(std::integral_constant<int64_t, 6>{});
    case 5: return f(std::integral_constant<int64_t, 5>{});
    case 4: return f(std::integral_constant<int64_t, 4>{});
    case 3: return f(std::integral_constant<int64_t, 3>{});
    case 2: return f(std::integral_constant<int64_t, 2>{});
    default: return f(std::integral_constant<int64_t, 1>{});
  }
}

// ---- Generic: any dtype, head size and block size, in float ------------------------------

// Scores of kG query heads over one block of keys [D/2, block, 2]: each pair of key rows is
// widened to float once and feeds kG FMAs across the block's positions.
template <typename T, int64_t kD, int64_t kBlock, int64_t kG>
inline void score_block(const float* qf, const T* keys, int64_t dim, int64_t block,
                        float (*part)[kBlock ? kBlock : 256]) {
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t j = 0; j < block; ++j) part[g][j] = 0.f;
  for (int64_t p = 0; p < dim / 2; ++p) {
    const T* row = keys + p * block * 2;
    float k0[kBlock ? kBlock : 256], k1[kBlock ? kBlock : 256];
#pragma omp simd
    for (int64_t j = 0; j < block; ++j) {
      k0[j] = to_float(row[2 * j]);
      k1[j] = to_float(row[2 * j + 1]);
    }
    for (int64_t g = 0; g < kG; ++g) {
      const float q0 = qf[g * dim + 2 * p], q1 = qf[g * dim + 2 * p + 1];
#pragma omp simd
      for (int64_t j = 0; j < block; ++j) part[g][j] += q0 * k0[j] + q1 * k1[j];
    }
  }
}

// Weighted sum of values [block/2, D, 2] for kG query heads: each value row is widened once
// and feeds kG accumulators.
template <typename T, int64_t kD, int64_t kBlock, int64_t kG>
inline void sum_values(const Shape& s, int64_t h, const T* v_cache, const int32_t* table,
                       int64_t first, int64_t end, const float* p, int64_t len, float* acc) {
  const int64_t dim = kD ? kD : s.dim, block = kBlock ? kBlock : s.block;
  float a[kG][kD ? kD : 512] = {};
  for (int64_t pos = first; pos < end;) {
    const int64_t offset = pos % block, n = std::min(block - offset, end - pos);
    const T* values = v_cache + s.at.of(table[pos / block], h);
    if (pos + n < end) prefetch(v_cache + s.at.of(table[(pos + n) / block], h),
                                dim * block * sizeof(T));
    for (int64_t j = offset; j < offset + n; ++j) {
      const T* row = values + (j - j % 2) * dim + j % 2;
      float v[kD ? kD : 512];
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) v[i] = to_float(row[2 * i]);
      for (int64_t g = 0; g < kG; ++g) {
        const float w = p[g * len + pos - first + j - offset];
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) a[g][i] += w * v[i];
      }
    }
    pos += n;
  }
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] = a[g][i];
}

// kG query heads of one KV head: scores, an exact softmax in float, then the values.
template <typename T, int64_t kD, int64_t kBlock, int64_t kG>
void attend_chunk(const Shape& s, int64_t h, const float* qf, const T* k_cache, const T* v_cache,
                  const int32_t* table, int64_t first, int64_t end, float* scores, float* acc) {
  const int64_t dim = kD ? kD : s.dim, block = kBlock ? kBlock : s.block;
  const int64_t len = end - first;
  for (int64_t pos = first; pos < end;) {
    const int64_t offset = pos % block, n = std::min(block - offset, end - pos);
    const T* keys = k_cache + s.at.of(table[pos / block], h);
    if (pos + n < end) prefetch(k_cache + s.at.of(table[(pos + n) / block], h),
                                dim * block * sizeof(T));
    float part[kG][kBlock ? kBlock : 256];
    score_block<T, kD, kBlock, kG>(qf, keys, dim, block, part);
    for (int64_t g = 0; g < kG; ++g)
      for (int64_t j = 0; j < n; ++j) scores[g * len + pos - first + j] = part[g][offset + j];
    pos += n;
  }
  for (int64_t g = 0; g < kG; ++g) softmax_float(scores + g * len, 0, 0, len, len);
  sum_values<T, kD, kBlock, kG>(s, h, v_cache, table, first, end, scores, len, acc);
}

// One (sequence, KV head), every query head of its group, up to kGroupMax heads per pass. kD
// and kBlock are compile-time sizes (0: take them from `s`).
template <typename T, int64_t kD, int64_t kBlock>
void attend_one(const Shape& s, int64_t seq, int64_t h, const T* q, const T* k_cache,
                const T* v_cache, const int32_t* table, int64_t first, int64_t end, T* out,
                std::vector<float>& scores, std::vector<float>& qf) {
  const int64_t dim = kD ? kD : s.dim, groups = s.groups, len = end - first;
  const int64_t chunk = std::min(kGroupMax, groups);
  scores.resize(chunk * len);
  qf.resize(groups * dim);
  std::vector<float> acc(chunk * dim);
  for (int64_t g = 0; g < groups; ++g) {
    const T* src = q + seq * s.q_stride + (h * groups + g) * dim;
    for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] = to_float(src[i]) * s.scale;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupMax) {
    const int64_t n = std::min(kGroupMax, groups - g0);
    const float* qg = qf.data() + g0 * dim;
    auto run = [&](auto heads) {
      attend_chunk<T, kD, kBlock, decltype(heads)::value>(s, h, qg, k_cache, v_cache, table,
                                                          first, end, scores.data(), acc.data());
    };
    with_heads(n, run);
    T* dst = out + seq * s.n_heads * dim + (h * groups + g0) * dim;
    for (int64_t i = 0; i < n * dim; ++i) dst[i] = from_float<T>(acc[i]);
  }
}

// ---- bf16 with AVX512-BF16, 16-position blocks ------------------------------------------

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int64_t kB = 16;
constexpr int64_t kAhead = 2;  // blocks prefetched ahead
// Blocks of values whose P.V slices are taken in turn (see attend_chunk_bf16): 64 positions,
// 16 KB of one head's values at head size 128, in L1 for every slice after the first.
constexpr int64_t kPvBlocks = 4;
// Vectors of 16 dimensions per P.V slice: the most that divide kC with kG * kS accumulators
// in 24 of the 32 registers.
constexpr int64_t pv_slice(int64_t g, int64_t c) {
  int64_t best = 1;
  for (int64_t k = 1; k <= c; ++k)
    if (c % k == 0 && g * k <= 24) best = k;
  return best;
}

// kG query heads of one KV head (their q rows are consecutive, kD bf16 each) over positions
// [first, end). scores and probs hold kG rows of `width` positions from first's block start.
template <int64_t kD, int64_t kG>
void attend_chunk_bf16(const Shape& s, int64_t h, const uint16_t* q, const uint16_t* k_cache,
                       const uint16_t* v_cache, const int32_t* table, int64_t first,
                       int64_t end, float* scores, uint16_t* probs, float* acc_out) {
  constexpr int64_t kPairs = kD / 2, kC = kD / 16;
  const int64_t b0 = first / kB, b1 = (end + kB - 1) / kB, width = (b1 - b0) * kB;
  const int64_t lo = first - b0 * kB, hi = end - b0 * kB;  // attended: [lo, hi)
  const auto* qp = reinterpret_cast<const int32_t*>(q);  // [kG][kPairs] bf16 pairs
  const __m512 scale = _mm512_set1_ps(s.scale);
  // Scores: two accumulators per head (even and odd dimension pairs) hide VDPBF16PS latency.
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* keys = k_cache + s.at.of(table[b], h);  // [D/2, 16, 2]
    // The block kAhead on, or past the last the first value blocks (for the P.V pass): its
    // lines two per step below, not in one burst, which stalls on the line fill buffers.
    const int64_t ahead = b + kAhead;
    const char* next = nullptr;
    if (ahead < b1)
      next = reinterpret_cast<const char*>(k_cache + s.at.of(table[ahead], h));
    else if (ahead - (b1 - b0) < b1)
      next = reinterpret_cast<const char*>(v_cache + s.at.of(table[ahead - (b1 - b0)], h));
    __m512 acc[kG][2];
    for (int64_t g = 0; g < kG; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairs; p += 2) {
      if (next) {  // a block is kD / 2 lines: kPairs / 2 steps of two
        _mm_prefetch(next + p * 64, _MM_HINT_T1);
        _mm_prefetch(next + p * 64 + 64, _MM_HINT_T1);
      }
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + p * kB * 2);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + (p + 1) * kB * 2);
      for (int64_t g = 0; g < kG; ++g) {
        acc[g][0] = _mm512_dpbf16_ps(acc[g][0], k0,
                                     (__m512bh)_mm512_set1_epi32(qp[g * kPairs + p]));
        acc[g][1] = _mm512_dpbf16_ps(acc[g][1], k1,
                                     (__m512bh)_mm512_set1_epi32(qp[g * kPairs + p + 1]));
      }
    }
    for (int64_t g = 0; g < kG; ++g)
      _mm512_storeu_ps(scores + g * width + (b - b0) * kB,
                       _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), scale));
  }
  for (int64_t b = b0; b < std::min(b1, b0 + kPvBlocks); ++b)  // P.V's first chunk
    prefetch(v_cache + s.at.of(table[b], h), kD * kB * 2);
  // Exact softmax per head over [lo, hi); P in bf16, zero outside it.
  for (int64_t g = 0; g < kG; ++g)
    softmax_bf16(scores + g * width, probs + g * width, 0, lo, hi, width);
  // P.V, two positions per VDPBF16PS. A pair half outside [lo, hi) is masked to zero when
  // loaded: a stale value there (another sequence's, even a NaN) must not reach 0 * value.
  // kG heads' kD sums do not all fit in registers: they go kS vectors (of 16 dimensions) at a
  // time, over chunks of kPvBlocks blocks, so that a chunk's values, read from memory by the
  // first slice, are in L1 for the others. Each sum still adds its positions in order. The
  // slices of a chunk bring the next chunk between them, a few lines a pair: reading the
  // values then overlaps all of the slices' products, not only the first's.
  const auto* pp = reinterpret_cast<const int32_t*>(probs);  // [kG][width / 2] pairs
  constexpr int64_t kS = pv_slice(kG, kC);
  for (int64_t cb = b0; cb < b1; cb += kPvBlocks) {
    const int64_t ce = std::min(b1, cb + kPvBlocks);
    BlockLines<kPvBlocks, kD / 2> next(s, v_cache, table, h, ce, std::min(b1, ce + kPvBlocks));
    const int64_t pairs = (kC / kS) * (ce - cb) * (kB / 2);
    const int64_t per_pair = (next.lines + pairs - 1) / pairs;
    for (int64_t c0 = 0; c0 < kC; c0 += kS) {
      __m512 acc[kG][kS];
      for (int64_t g = 0; g < kG; ++g)
        for (int64_t c = 0; c < kS; ++c)
          acc[g][c] = cb == b0 ? _mm512_setzero_ps()
                               : _mm512_loadu_ps(acc_out + g * kD + (c0 + c) * 16);
      for (int64_t b = cb; b < ce; ++b) {
        const uint16_t* values = v_cache + s.at.of(table[b], h);  // [8, D, 2]
        const int64_t base = (b - b0) * kB;
        const int64_t j0 = std::max<int64_t>(lo - base, 0) / 2;
        const int64_t j1 = (std::min<int64_t>(hi - base, kB) + 1) / 2;
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t t = base + 2 * j;  // the pair's first position
          next.fetch(per_pair);
          const __mmask32 keep = t < lo ? 0xAAAAAAAAu : t + 1 >= hi ? 0x55555555u : 0xFFFFFFFFu;
          __m512bh v[kS];
          for (int64_t c = 0; c < kS; ++c)
            v[c] = (__m512bh)_mm512_maskz_loadu_epi16(keep,
                                                      values + (j * kD + (c0 + c) * 16) * 2);
          for (int64_t g = 0; g < kG; ++g) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[g * width / 2 + t / 2]);
            for (int64_t c = 0; c < kS; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], v[c], w);
          }
        }
      }
      for (int64_t g = 0; g < kG; ++g)
        for (int64_t c = 0; c < kS; ++c)
          _mm512_storeu_ps(acc_out + g * kD + (c0 + c) * 16, acc[g][c]);
    }
  }
}

template <int64_t kD>
void attend_one_bf16(const Shape& s, int64_t seq, int64_t h, const c10::BFloat16* q,
                     const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                     const int32_t* table, int64_t first, int64_t end, c10::BFloat16* out,
                     std::vector<float>& scores, std::vector<uint16_t>& probs) {
  const int64_t width = ((end + kB - 1) / kB - first / kB) * kB, groups = s.groups;
  const int64_t chunk = std::min(kGroupMax, groups);
  scores.resize(chunk * width);
  probs.resize(chunk * width);
  float acc[kGroupMax * kD];
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupMax) {
    const int64_t n = std::min(kGroupMax, groups - g0);
    const auto* qg = reinterpret_cast<const uint16_t*>(q + seq * s.q_stride + (h * groups + g0) * kD);
    auto run = [&](auto heads) {
      attend_chunk_bf16<kD, decltype(heads)::value>(s, h, qg, kc, vc, table, first, end,
                                                    scores.data(), probs.data(), acc);
    };
    with_heads(n, run);
    c10::BFloat16* dst = out + seq * s.n_heads * kD + (h * groups + g0) * kD;
#pragma omp simd
    for (int64_t i = 0; i < n * kD; ++i) dst[i] = from_float<c10::BFloat16>(acc[i]);
  }
}
#endif

#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__FMA__)
#define INFER_ATTENTION_AVX2 1
// ---- bf16 on AVX2 (laptops), 16-position blocks -----------------------------------------
//
// A bf16 is the top half of a float, and each 32-bit lane of the cache holds two: two
// dimensions of one key position, or one dimension of two value positions. A shift and a
// mask make them two vectors of 8 floats for the FMAs, with no strided widening and no sums
// in memory (the generic loop's). Scores go 8 positions and up to 4 heads at a time (8
// sums), P.V 16 dimensions and up to 2 heads (8 sums, even and odd positions apart), so that
// the sums stay in the 16 registers. The reads are spread over the FMAs (see the prefetches
// below): the loop is bound by its FMAs, whether the cache comes from memory or from L3. P
// stays float, as in the generic loop.
constexpr int64_t kB2 = 16;
constexpr int64_t kAhead2 = 2;  // key blocks prefetched ahead
// Blocks of values whose P.V slices are taken in turn: 16 KB of one head's values at head
// size 128, in L1 for every slice after the first. The slices of a chunk bring the next
// chunk between them, so that reading the values overlaps their FMAs.
constexpr int64_t kPvBlocks2 = 4;

// The floats of each lane's bf16 pair: its low half in lo, its high half in hi.
inline void unpair(__m256i v, __m256& lo, __m256& hi) {
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Scores of kH heads (q rows kD floats apart, scaled) against one block's 16 keys [kD/2, 16,
// 2], into out[g * ld + 0 .. 16). It makes two passes over the block (8 positions each), pass
// `pass` of `passes` of this block: each brings its share of the lines of `next` (a block is
// kD / 2 lines), so that the reads spread over the block's FMAs rather than stall them.
template <int64_t kD, int64_t kH>
inline void score_block_avx2(const uint16_t* keys, const float* q, float* out, int64_t ld,
                             const char* next, int64_t pass, int64_t passes) {
  const int64_t share = (kD / 2 + passes - 1) / passes;  // lines a pass
  for (int64_t half = 0; half < 2; ++half, ++pass) {
    __m256 acc[kH][2];  // even and odd dimensions apart: two chains a head
    for (int64_t g = 0; g < kH; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    const char* pf = next ? next + pass * share * 64 : nullptr;
    const int64_t pf_lines = next ? std::min(share, kD / 2 - pass * share) : 0;
    for (int64_t p = 0; p < kD / 2; ++p) {
      if (p < pf_lines) _mm_prefetch(pf + p * 64, _MM_HINT_T1);
      __m256 even, odd;
      unpair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + p * 2 * kB2 + half * 16)),
             even, odd);
      for (int64_t g = 0; g < kH; ++g) {
        acc[g][0] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(q + g * kD + 2 * p), acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(q + g * kD + 2 * p + 1), acc[g][1]);
      }
    }
    for (int64_t g = 0; g < kH; ++g)
      _mm256_storeu_ps(out + g * ld + half * 8, _mm256_add_ps(acc[g][0], acc[g][1]));
  }
}

// acc[g * kD + d0 .. + 16) += P[g] . V over the attended positions [lo, hi) of blocks [cb, ce)
// (P rows `ld` apart, from block b0's first position), for kH heads. A pair half outside
// [lo, hi) is masked to zero when loaded: a stale value there (even a NaN) must not reach
// 0 * value. Each pair brings one of the lines of `next` this slice is given: the slices of a
// chunk share out the next chunk's, so that its reads overlap all of this one's FMAs.
template <int64_t kD, int64_t kH, typename Lines>
inline void pv_slice_avx2(const Shape& s, int64_t h, const uint16_t* v_cache,
                          const int32_t* table, int64_t b0, int64_t cb, int64_t ce, int64_t lo,
                          int64_t hi, const float* p, int64_t ld, int64_t d0, Lines& next,
                          float* acc_out) {
  __m256 acc[kH][2][2];  // [head][dimensions d0 + 8c][even, odd position]
  for (int64_t g = 0; g < kH; ++g)
    for (int64_t c = 0; c < 2; ++c) {
      acc[g][c][0] = _mm256_loadu_ps(acc_out + g * kD + d0 + 8 * c);
      acc[g][c][1] = _mm256_setzero_ps();
    }
  for (int64_t b = cb; b < ce; ++b) {
    const uint16_t* values = v_cache + s.at.of(table[b], h);  // [8, kD, 2]
    const int64_t base = (b - b0) * kB2;
    const int64_t j0 = std::max<int64_t>(lo - base, 0) / 2;
    const int64_t j1 = (std::min<int64_t>(hi - base, kB2) + 1) / 2;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t t = base + 2 * j;  // the pair's first position
      next.fetch(1);
      const uint16_t* row = values + (j * kD + d0) * 2;
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16));
      if (t < lo || t + 1 >= hi) {
        const __m256i keep = _mm256_set1_epi32(static_cast<int>(
            (t >= lo ? 0x0000FFFFu : 0u) | (t + 1 < hi ? 0xFFFF0000u : 0u)));
        v0 = _mm256_and_si256(v0, keep);
        v1 = _mm256_and_si256(v1, keep);
      }
      __m256 e0, o0, e1, o1;
      unpair(v0, e0, o0);
      unpair(v1, e1, o1);
      for (int64_t g = 0; g < kH; ++g) {
        const __m256 pe = _mm256_broadcast_ss(p + g * ld + t);
        const __m256 po = _mm256_broadcast_ss(p + g * ld + t + 1);
        acc[g][0][0] = _mm256_fmadd_ps(e0, pe, acc[g][0][0]);
        acc[g][0][1] = _mm256_fmadd_ps(o0, po, acc[g][0][1]);
        acc[g][1][0] = _mm256_fmadd_ps(e1, pe, acc[g][1][0]);
        acc[g][1][1] = _mm256_fmadd_ps(o1, po, acc[g][1][1]);
      }
    }
  }
  for (int64_t g = 0; g < kH; ++g)
    for (int64_t c = 0; c < 2; ++c)
      _mm256_storeu_ps(acc_out + g * kD + d0 + 8 * c, _mm256_add_ps(acc[g][c][0], acc[g][c][1]));
}

// f(std::integral_constant<int64_t, n>{}) for n in [1, 4]: a block of heads.
template <typename F>
inline void with_block(int64_t n, const F& f) {
  switch (n) {
    case 4: return f(std::integral_constant<int64_t, 4>{});
    case 3: return f(std::integral_constant<int64_t, 3>{});
    case 2: return f(std::integral_constant<int64_t, 2>{});
    default: return f(std::integral_constant<int64_t, 1>{});
  }
}

// kG query heads of one KV head (q rows of kD floats, scaled) over positions [first, end):
// scores, an exact softmax in float, then P.V into acc [kG][kD]. scores holds kG rows of the
// positions from first's block start.
template <int64_t kD>
void attend_chunk_avx2(const Shape& s, int64_t h, int64_t heads, const float* qf,
                       const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table,
                       int64_t first, int64_t end, float* scores, float* acc) {
  const int64_t b0 = first / kB2, b1 = (end + kB2 - 1) / kB2, width = (b1 - b0) * kB2;
  const int64_t lo = first - b0 * kB2, hi = end - b0 * kB2;  // attended: [lo, hi)
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* keys = k_cache + s.at.of(table[b], h);  // [kD/2, 16, 2]
    const char* next = b + kAhead2 < b1 ? reinterpret_cast<const char*>(
                                              k_cache + s.at.of(table[b + kAhead2], h))
                                        : nullptr;
    const int64_t passes = 2 * ((heads + 3) / 4);
    for (int64_t g0 = 0; g0 < heads; g0 += 4) {
      with_block(std::min<int64_t>(4, heads - g0), [&](auto n) {
        score_block_avx2<kD, decltype(n)::value>(keys, qf + g0 * kD,
                                                 scores + g0 * width + (b - b0) * kB2, width,
                                                 next, g0 / 2, passes);
      });
    }
  }
  for (int64_t b = b0; b < std::min(b1, b0 + kPvBlocks2); ++b)  // P.V's first chunk
    prefetch(v_cache + s.at.of(table[b], h), kD * kB2 * 2);
  for (int64_t g = 0; g < heads; ++g)  // P over [lo, hi), zero outside it
    softmax_float(scores + g * width, 0, lo, hi, width);
  for (int64_t i = 0; i < heads * kD; ++i) acc[i] = 0.f;
  // chunks of kPvBlocks2 blocks, each taken by every (head block, 16 dimensions) slice in turn,
  // from L1 after the first; the slices share out the next chunk's lines
  for (int64_t cb = b0; cb < b1; cb += kPvBlocks2) {
    const int64_t ce = std::min(b1, cb + kPvBlocks2);
    BlockLines<kPvBlocks2, kD / 2> next(s, v_cache, table, h, ce, std::min(b1, ce + kPvBlocks2));
    const int64_t slices = (heads + 1) / 2 * (kD / 16);
    const int64_t share = (next.lines + slices - 1) / slices;
    int64_t slice = 0;
    for (int64_t g0 = 0; g0 < heads; g0 += 2) {
      with_block(std::min<int64_t>(2, heads - g0), [&](auto n) {
        for (int64_t d0 = 0; d0 < kD; d0 += 16, ++slice) {
          next.line = std::min(next.lines, slice * share);
          next.end = std::min(next.lines, (slice + 1) * share);
          pv_slice_avx2<kD, decltype(n)::value>(s, h, v_cache, table, b0, cb, ce, lo, hi,
                                                scores + g0 * width, width, d0, next,
                                                acc + g0 * kD);
        }
      });
    }
  }
}

template <int64_t kD>
void attend_one_avx2(const Shape& s, int64_t seq, int64_t h, const c10::BFloat16* q,
                     const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                     const int32_t* table, int64_t first, int64_t end, c10::BFloat16* out,
                     std::vector<float>& scores, std::vector<float>& qf) {
  const int64_t width = ((end + kB2 - 1) / kB2 - first / kB2) * kB2, groups = s.groups;
  const int64_t chunk = std::min(kGroupMax, groups);
  scores.resize(chunk * width);
  qf.resize(groups * kD);
  alignas(32) float acc[kGroupMax * kD];
  for (int64_t g = 0; g < groups; ++g) {
    const c10::BFloat16* src = q + seq * s.q_stride + (h * groups + g) * kD;
    for (int64_t i = 0; i < kD; ++i) qf[g * kD + i] = to_float(src[i]) * s.scale;
  }
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupMax) {
    const int64_t n = std::min(kGroupMax, groups - g0);
    attend_chunk_avx2<kD>(s, h, n, qf.data() + g0 * kD, kc, vc, table, first, end,
                          scores.data(), acc);
    c10::BFloat16* dst = out + seq * s.n_heads * kD + (h * groups + g0) * kD;
    for (int64_t i = 0; i < n * kD; ++i) dst[i] = from_float<c10::BFloat16>(acc[i]);
  }
}
#endif

// The first position a sequence of `stop` positions attends (its sliding window's start).
inline int64_t attended_from(const Shape& s, int64_t stop) {
  return s.window > 0 ? std::max<int64_t>(0, stop - s.window) : 0;
}

// Every (sequence, KV head) of the batch. Waking a second thread costs tens of microseconds
// when OpenMP threads sleep between regions (OMP_WAIT_POLICY=PASSIVE); in a decode step they
// are still spinning from the linear before (GOMP_SPINCOUNT, infer/__init__.py). Below a few
// hundred positions, run in this thread.
template <typename F>
void for_each_head(const Shape& s, const int32_t* lens, const F& fn) {
  int64_t positions = 0;
  for (int64_t i = 0; i < s.n_seqs; ++i) positions += lens[i];
  const int64_t items = s.n_seqs * s.n_kv;
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.n_kv, h = item % s.n_kv, stop = lens[seq];
      const int64_t start = attended_from(s, stop);
      if (stop > start) fn(seq, h, start, stop);
    }
  };
  if (positions * s.n_kv < 512) {
    work(0, items);
  } else {
    // Chunks of a few items: each item prefetches the next one's first blocks.
    parallel_eighths(items, work);
  }
}

template <typename T, int64_t kD, int64_t kBlock>
void decode_all(const Shape& s, const T* q, const T* k_cache, const T* v_cache,
                const int32_t* tables, const int32_t* lens, T* out) {
  TORCH_CHECK(s.block <= 256 && s.dim <= 512, "block_size <= 256 and head_dim <= 512 supported");
  for_each_head(s, lens, [&](int64_t seq, int64_t h, int64_t first, int64_t end) {
    thread_local std::vector<float> scores, qf;
    attend_one<T, kD, kBlock>(s, seq, h, q, k_cache, v_cache, tables + seq * s.max_blocks,
                              first, end, out, scores, qf);
  });
}

template <typename T>
void dispatch(const Shape& s, const T* q, const T* k, const T* v, const int32_t* tables,
              const int32_t* lens, T* out) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (s.block == kB && (s.dim == 64 || s.dim == 128 || s.dim == 256)) {
      for_each_head(s, lens, [&](int64_t seq, int64_t h, int64_t first, int64_t end) {
        thread_local std::vector<float> scores;
        thread_local std::vector<uint16_t> probs;
        // The next item's first blocks: each item prefetches only its own later blocks.
        const int64_t next = seq * s.n_kv + h + 1;
        if (next < s.n_seqs * s.n_kv) {
          const int64_t nseq = next / s.n_kv, nh = next % s.n_kv, stop = lens[nseq];
          const int64_t start = attended_from(s, stop);
          const int32_t* ntable = tables + nseq * s.max_blocks;
          for (int64_t b = start / kB; b < std::min(start / kB + kAhead, (stop + kB - 1) / kB); ++b)
            prefetch(k + s.at.of(ntable[b], nh), s.dim * kB * 2);
        }
        const int32_t* table = tables + seq * s.max_blocks;
        if (s.dim == 64)
          attend_one_bf16<64>(s, seq, h, q, k, v, table, first, end, out, scores, probs);
        else if (s.dim == 128)
          attend_one_bf16<128>(s, seq, h, q, k, v, table, first, end, out, scores, probs);
        else
          attend_one_bf16<256>(s, seq, h, q, k, v, table, first, end, out, scores, probs);
      });
      return;
    }
  }
#endif
#ifdef INFER_ATTENTION_AVX2
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (s.block == kB2 && (s.dim == 64 || s.dim == 128 || s.dim == 256)) {
      for_each_head(s, lens, [&](int64_t seq, int64_t h, int64_t first, int64_t end) {
        thread_local std::vector<float> scores, qf;
        const int32_t* table = tables + seq * s.max_blocks;
        if (s.dim == 64)
          attend_one_avx2<64>(s, seq, h, q, k, v, table, first, end, out, scores, qf);
        else if (s.dim == 128)
          attend_one_avx2<128>(s, seq, h, q, k, v, table, first, end, out, scores, qf);
        else
          attend_one_avx2<256>(s, seq, h, q, k, v, table, first, end, out, scores, qf);
      });
      return;
    }
  }
#endif
  if (s.block == 16 && s.dim == 64) return decode_all<T, 64, 16>(s, q, k, v, tables, lens, out);
  if (s.block == 16 && s.dim == 128) return decode_all<T, 128, 16>(s, q, k, v, tables, lens, out);
  if (s.block == 16 && s.dim == 256) return decode_all<T, 256, 16>(s, q, k, v, tables, lens, out);
  decode_all<T, 0, 0>(s, q, k, v, tables, lens, out);
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [N, H, D]");
  const CacheStrides at = cache_strides(k_cache, v_cache);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) == v_cache.size(3), "head dims differ");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous [N, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous [N]");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  Shape s{q.size(0), q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2),
          k_cache.size(3), block_tables.size(1), q.stride(0), window,
          static_cast<float>(scale), at};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch<scalar_t>(s, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                       v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                       seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

