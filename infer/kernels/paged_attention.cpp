// Paged attention for decode on CPU: one query token per sequence, keys and values read
// straight from the block pool through each sequence's block table.
//
// Layouts (per layer): keys [blocks, kv_heads, head_dim, block_size] -- transposed inside a
// block, so that the scores of a whole block come from broadcast FMAs across its positions
// with no horizontal sums -- and values [blocks, kv_heads, block_size, head_dim]. Each
// (sequence, KV head) reads its own blocks once, for its own length, for every query head of
// its group. SDPA over a padded, gathered cache spent most of its time on per-(batch, head)
// setup at these sizes (3 query heads per KV head, a few hundred positions).
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
};

// Ask for the next block while this one is being used: a sequence's blocks are scattered
// over the pool, so the hardware prefetcher cannot guess them.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Scores of kG query heads (one group chunk) over one block of keys [D, block]: each key
// row is widened to float once and feeds kG FMAs across the block's positions.
template <typename T, int64_t kD, int64_t kBlock, int64_t kG>
inline void score_block(const float* qf, const T* keys, int64_t dim, int64_t block,
                        float (*part)[kBlock ? kBlock : 256]) {
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t j = 0; j < block; ++j) part[g][j] = 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    const T* row = keys + i * block;
    float k[kBlock ? kBlock : 256];
#pragma omp simd
    for (int64_t j = 0; j < block; ++j) k[j] = to_float(row[j]);
    for (int64_t g = 0; g < kG; ++g) {
      const float qi = qf[g * dim + i];
#pragma omp simd
      for (int64_t j = 0; j < block; ++j) part[g][j] += qi * k[j];
    }
  }
}

#if defined(__AVX512F__)
// The same for bf16 blocks of 16 keys, in registers: GCC spills the widened key row of the
// generic loop to the stack and reloads it for every FMA.
template <int64_t kG>
inline void score_block_bf16(const float* qf, const c10::BFloat16* keys, int64_t dim,
                             float (*part)[16]) {
  __m512 acc[kG];
  for (int64_t g = 0; g < kG; ++g) acc[g] = _mm512_setzero_ps();
  const auto* rows = reinterpret_cast<const __m256i*>(keys);
  for (int64_t i = 0; i < dim; ++i) {
    const __m512 k = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(rows + i)), 16));
    for (int64_t g = 0; g < kG; ++g)
      acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * dim + i]), k, acc[g]);
  }
  for (int64_t g = 0; g < kG; ++g) _mm512_storeu_ps(part[g], acc[g]);
}
#endif

// Weighted sum of values for kG query heads: each value row is widened once and feeds kG
// register-resident accumulators.
template <typename T, int64_t kD, int64_t kBlock, int64_t kG>
inline void sum_values(const Shape& s, int64_t h, const T* v_cache, const int32_t* table,
                       int64_t first, int64_t end, const float* p, int64_t len, float* acc) {
  const int64_t dim = kD ? kD : s.dim, block = kBlock ? kBlock : s.block;
  const int64_t block_elems = s.n_kv * dim * block;
  float a[kG][kD ? kD : 512] = {};
  for (int64_t pos = first; pos < end;) {
    const int64_t offset = pos % block, n = std::min(block - offset, end - pos);
    const T* values = v_cache + table[pos / block] * block_elems + (h * block + offset) * dim;
    if (pos + n < end) prefetch(v_cache + table[(pos + n) / block] * block_elems + h * block * dim,
                                dim * block * sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      const T* row = values + j * dim;
      float v[kD ? kD : 512];
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) v[i] = to_float(row[i]);
      for (int64_t g = 0; g < kG; ++g) {
        const float w = p[g * len + pos - first + j];
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) a[g][i] += w * v[i];
      }
    }
    pos += n;
  }
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] = a[g][i];
}

// kG query heads of one KV head at a time (kG * kD floats of accumulators fit in registers).
template <typename T, int64_t kD, int64_t kBlock, int64_t kG>
void attend_chunk(const Shape& s, int64_t h, const float* qf, const T* k_cache, const T* v_cache,
                  const int32_t* table, int64_t first, int64_t end, float* scores, float* acc) {
  const int64_t dim = kD ? kD : s.dim, block = kBlock ? kBlock : s.block;
  const int64_t len = end - first, block_elems = s.n_kv * dim * block;
  for (int64_t pos = first; pos < end;) {
    const int64_t offset = pos % block, n = std::min(block - offset, end - pos);
    const T* keys = k_cache + table[pos / block] * block_elems + h * dim * block;  // [D, B]
    if (pos + n < end) prefetch(k_cache + table[(pos + n) / block] * block_elems + h * dim * block,
                                dim * block * sizeof(T));
    float part[kG][kBlock ? kBlock : 256];
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && kBlock == 16)
      score_block_bf16<kG>(qf, keys, dim, part);
    else
#endif
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

// Query heads per pass: as many as keep kG * D accumulators within 16 AVX-512 registers.
constexpr int64_t chunk_heads(int64_t dim) { return dim && dim <= 64 ? 4 : dim <= 128 ? 2 : 1; }

// One (sequence, KV head): every query head of its group reads the sequence's keys and
// values once per chunk of heads. kD and kBlock are compile-time sizes (0: take them from
// `s`), so that the common shapes get fully unrolled, register-resident inner loops.
template <typename T, int64_t kD, int64_t kBlock>
void attend_one(const Shape& s, int64_t seq, int64_t h, const T* q, const T* k_cache,
                const T* v_cache, const int32_t* table, int64_t end, T* out,
                std::vector<float>& scores, std::vector<float>& qf) {
  const int64_t dim = kD ? kD : s.dim, block = kBlock ? kBlock : s.block;
  const int64_t groups = s.groups;
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, end - s.window) : 0;
  const int64_t len = end - first;
  if (len <= 0) return;
  TORCH_CHECK(block <= 256 && dim <= 512, "block_size <= 256 and head_dim <= 512 supported");
  constexpr int64_t kChunk = chunk_heads(kD);
  scores.resize(kChunk * len);
  std::vector<float> acc(kChunk * dim);
  for (int64_t g = 0; g < groups; ++g) {
    const T* src = q + seq * s.q_stride + (h * groups + g) * dim;
    for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] = to_float(src[i]) * s.scale;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int64_t n = std::min(kChunk, groups - g0);
    const float* qg = qf.data() + g0 * dim;
    switch (n) {
      case 4: attend_chunk<T, kD, kBlock, 4>(s, h, qg, k_cache, v_cache, table, first, end,
                                             scores.data(), acc.data()); break;
      case 3: attend_chunk<T, kD, kBlock, 3>(s, h, qg, k_cache, v_cache, table, first, end,
                                             scores.data(), acc.data()); break;
      case 2: attend_chunk<T, kD, kBlock, 2>(s, h, qg, k_cache, v_cache, table, first, end,
                                             scores.data(), acc.data()); break;
      default: attend_chunk<T, kD, kBlock, 1>(s, h, qg, k_cache, v_cache, table, first, end,
                                              scores.data(), acc.data()); break;
    }
    T* dst = out + seq * s.n_heads * dim + (h * groups + g0) * dim;
    for (int64_t i = 0; i < n * dim; ++i) dst[i] = from_float<T>(acc[i]);
  }
}

template <typename T, int64_t kD, int64_t kBlock>
void decode_all(const Shape& s, const T* q, const T* k_cache, const T* v_cache,
                const int32_t* tables, const int32_t* lens, T* out) {
  // Waking a second thread costs tens of microseconds when OpenMP threads sleep between
  // regions (OMP_WAIT_POLICY=PASSIVE): below a few thousand positions, run in this thread.
  int64_t positions = 0;
  for (int64_t i = 0; i < s.n_seqs; ++i) positions += lens[i];
  const int64_t items = s.n_seqs * s.n_kv;
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(s.groups * s.dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.n_kv, h = item % s.n_kv;
      attend_one<T, kD, kBlock>(s, seq, h, q, k_cache, v_cache, tables + seq * s.max_blocks,
                                lens[seq], out, scores, qf);
    }
  };
  if (positions * s.n_kv < 4096) {
    work(0, items);
  } else {
    at::parallel_for(0, items, 1, work);
  }
}

template <typename T>
void dispatch(const Shape& s, const T* q, const T* k, const T* v, const int32_t* tables,
              const int32_t* lens, T* out) {
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
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be 4-D");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "k_cache must be [blocks, kv_heads, D, block] and v_cache [blocks, kv_heads, "
              "block, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
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
          v_cache.size(2), block_tables.size(1), q.stride(0), window,
          static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch<scalar_t>(s, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                       v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                       seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

