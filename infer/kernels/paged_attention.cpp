// Paged attention for decode on CPU: one query token per sequence, keys and values read
// straight from the block pool through each sequence's block table.
//
// Layouts (per layer, see PagedKVCache and cache_strides): keys [blocks, kv_heads, head_dim / 2,
// block, 2] and values [blocks, kv_heads, block / 2, head_dim, 2]. With AVX512-BF16 and
// 16-position blocks, one VDPBF16PS scores a query against a block's 16 positions two dimensions at a time (no
// horizontal sums), and one adds two positions' weighted values (P rounded to bf16, as the
// prefill kernel and torch's flash kernel do): a third of the instructions of widening bf16
// to float and FMA-ing. Elsewhere a generic loop computes the same in float. Each (sequence,
// KV head) reads its own blocks from memory once, for its own length, for every query head
// of its group.
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
  CacheStrides at;  // where block b's slab of head h starts: b * at.block + h * at.head
};

// Ask for a block before it is used: a sequence's blocks are scattered over the pool, so the
// hardware prefetcher cannot guess them. Into L2 (prefetcht1), which keeps more misses in
// flight than L1: one thread streamed the cache at 7 GB/s with prefetcht0 one block ahead,
// 12 GB/s with prefetcht1 two blocks ahead (batch 64 x 512 positions, this Zen 4).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

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
    const T* values = v_cache + table[pos / block] * s.at.block + h * s.at.head;
    if (pos + n < end) prefetch(v_cache + table[(pos + n) / block] * s.at.block + h * s.at.head,
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
    const T* keys = k_cache + table[pos / block] * s.at.block + h * s.at.head;
    if (pos + n < end) prefetch(k_cache + table[(pos + n) / block] * s.at.block + h * s.at.head,
                                dim * block * sizeof(T));
    float part[kG][kBlock ? kBlock : 256];
    score_block<T, kD, kBlock, kG>(qf, keys, dim, block, part);
    for (int64_t g = 0; g < kG; ++g)
      for (int64_t j = 0; j < n; ++j) scores[g * len + pos - first + j] = part[g][offset + j];
    pos += n;
  }
  for (int64_t g = 0; g < kG; ++g) {
    float* sg = scores + g * len;
    const float mx = row_max(sg, len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = fast_exp(sg[t] - mx);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
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
// Blocks of values whose P.V slices are taken in turn (see attend_chunk_bf16): 1024 positions,
// 256 KB of one head's values at head size 128, in L2 beside the scores.
constexpr int64_t kPvBlocks = 64;
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
    const uint16_t* keys = k_cache + table[b] * s.at.block + h * s.at.head;  // [D/2, 16, 2]
    // The block kAhead on, or past the last the first value blocks (for the P.V pass): its
    // lines two per step below, not in one burst, which stalls on the line fill buffers.
    const int64_t ahead = b + kAhead;
    const char* next = nullptr;
    if (ahead < b1)
      next = reinterpret_cast<const char*>(k_cache + table[ahead] * s.at.block + h * s.at.head);
    else if (ahead - (b1 - b0) < b1)
      next = reinterpret_cast<const char*>(v_cache + table[ahead - (b1 - b0)] * s.at.block +
                                           h * s.at.head);
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
  // Exact softmax per head over [lo, hi); P in bf16, zero outside it.
  for (int64_t g = 0; g < kG; ++g)
    softmax_bf16(scores + g * width, probs + g * width, 0, lo, hi, width);
  // P.V, two positions per VDPBF16PS. A pair half outside [lo, hi) is masked to zero when
  // loaded: a stale value there (another sequence's, even a NaN) must not reach 0 * value.
  // kG heads' kD sums do not all fit in registers: they go kS vectors (of 16 dimensions) at a
  // time, over chunks of kPvBlocks blocks, so that a chunk's values, read from memory by the
  // first slice, are in L2 for the others. Each sum still adds its positions in order.
  const auto* pp = reinterpret_cast<const int32_t*>(probs);  // [kG][width / 2] pairs
  constexpr int64_t kS = pv_slice(kG, kC);
  for (int64_t cb = b0; cb < b1; cb += kPvBlocks) {
    const int64_t ce = std::min(b1, cb + kPvBlocks);
    for (int64_t c0 = 0; c0 < kC; c0 += kS) {
      __m512 acc[kG][kS];
      for (int64_t g = 0; g < kG; ++g)
        for (int64_t c = 0; c < kS; ++c)
          acc[g][c] = cb == b0 ? _mm512_setzero_ps()
                               : _mm512_loadu_ps(acc_out + g * kD + (c0 + c) * 16);
      for (int64_t b = cb; b < ce; ++b) {
        const uint16_t* values = v_cache + table[b] * s.at.block + h * s.at.head;  // [8, D, 2]
        // the first slice brings the block kAhead on, a row a step (as the scores)
        const char* next = c0 == 0 && b + kAhead < b1
                               ? reinterpret_cast<const char*>(
                                     v_cache + table[b + kAhead] * s.at.block + h * s.at.head)
                               : nullptr;
        const int64_t base = (b - b0) * kB;
        const int64_t j0 = std::max<int64_t>(lo - base, 0) / 2;
        const int64_t j1 = (std::min<int64_t>(hi - base, kB) + 1) / 2;
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t t = base + 2 * j;  // the pair's first position
          if (next)
            for (int64_t line = 0; line < kD / 16; ++line)  // a row of the block: 2 kD bf16
              _mm_prefetch(next + (j * kD / 16 + line) * 64, _MM_HINT_T1);
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
            prefetch(k + ntable[b] * s.at.block + nh * s.at.head, s.dim * kB * 2);
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

