// Bidirectional attention of an encoder's right-padded rows (BERT), with AVX512-BF16.
//
// qkv is the fused q/k/v projection's output, [B, T, 3, H, D] bf16; row b's first lengths[b]
// tokens are real, the rest padding. Every real query attends every real key of its row.
// First, each (row, head)'s keys and values are packed into VDPBF16PS's operand layouts, as
// the paged cache holds them for paged_prefill_attention: keys [T/16, D/2, 16, 2] (16 keys as
// output columns), values [T/16, 8, D, 2]; both are zero past the row's length (P is 0 there,
// but 0 * NaN is NaN). Then each work item, a (row, head, block of 16 queries), computes its
// scores in float (8 query rows x 2 key blocks of accumulators), P = e^((s - max) scale)
// rounded to bf16, and P.V divided by the row's float sum, as paged_prefill_attention (and
// torch's flash kernel) does. torch's flash kernel took 12 ms a layer for 8 rows of 256
// tokens at D = 32 (bench/results/LOG.md): its blocking is made for larger heads.
//
// The output is [B, T, H * D] bf16, the o projection's input as it is; padding rows are 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kQ = 16;  // queries per work item; keys per packed block

// Scores of 8 query rows (qrow: their q, as bf16 pairs) against key blocks [b, b + NB) of one
// (row, head) (keys: its packed blocks, 16 * dim elements apart), unscaled, into
// scores[i][b * 16 ...].
template <int NB>
inline void score_tile(const uint16_t* keys, int64_t dim, const int32_t* const* qrow, int64_t b,
                       float* scores, int64_t width) {
  __m512 acc[8][NB];
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    __m512bh kv[NB];
    for (int j = 0; j < NB; ++j)
      kv[j] = (__m512bh)_mm512_loadu_si512(keys + ((b + j) * dim + p * 2) * kQ);
    for (int i = 0; i < 8; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qrow[i][p]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], kv[j], qb);
    }
  }
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(scores + i * width + (b + j) * kQ, acc[i][j]);
}

// out[i][0 .. 16 C) = P[i] . V * inv_sum[i] over key blocks [0, blocks), for R query rows.
template <int R, int C>
inline void pv_tile(const uint16_t* values, const uint16_t* probs, int64_t ldp,
                    const float* inv_sum, int64_t blocks, uint16_t* out, int64_t ldo) {
  constexpr int64_t dim = 16 * C;
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* vb = values + b * kQ * dim;  // [8, D, 2]
    for (int64_t jp = 0; jp < kQ / 2; ++jp) {
      __m512bh vv[C];
      for (int c = 0; c < C; ++c)
        vv[c] = (__m512bh)_mm512_loadu_si512(vb + (jp * dim + c * 16) * 2);
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, probs + i * ldp + b * kQ + 2 * jp, sizeof(pair));
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv[c], pb);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512 inv = _mm512_set1_ps(inv_sum[i]);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][c], inv)));
  }
}

template <int C>
void pv_rows(const uint16_t* values, const uint16_t* probs, int64_t ldp, const float* inv_sum,
             int64_t blocks, int64_t rows, uint16_t* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; r += 4) {
    const uint16_t* p = probs + r * ldp;
    uint16_t* o = out + r * ldo;
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: pv_tile<4, C>(values, p, ldp, inv_sum + r, blocks, o, ldo); break;
      case 3: pv_tile<3, C>(values, p, ldp, inv_sum + r, blocks, o, ldo); break;
      case 2: pv_tile<2, C>(values, p, ldp, inv_sum + r, blocks, o, ldo); break;
      default: pv_tile<1, C>(values, p, ldp, inv_sum + r, blocks, o, ldo); break;
    }
  }
}

struct Shape {
  int64_t rows, tokens, heads, dim, blocks;  // B, T, H, D, T / 16 rounded up
};

// Keys and values of (row b, head h) into their packed blocks, zero past the row's length.
void pack_head(const uint16_t* qkv, const Shape& s, int64_t b, int64_t h, int64_t length,
               uint16_t* keys, uint16_t* values) {
  const int64_t d2 = s.dim / 2, width = s.blocks * kQ;
  std::memset(keys, 0, width * s.dim * sizeof(uint16_t));
  std::memset(values, 0, width * s.dim * sizeof(uint16_t));
  for (int64_t t = 0; t < length; ++t) {
    const uint16_t* row = qkv + ((b * s.tokens + t) * 3 * s.heads + h) * s.dim;
    const uint16_t* k = row + s.heads * s.dim;
    const uint16_t* v = row + 2 * s.heads * s.dim;
    const int64_t blk = t / kQ, j = t % kQ;
    int32_t* kb = reinterpret_cast<int32_t*>(keys + blk * kQ * s.dim);  // [D/2, 16] pairs
    int32_t pair;
    for (int64_t p = 0; p < d2; ++p) {
      std::memcpy(&pair, k + 2 * p, sizeof(pair));
      kb[p * kQ + j] = pair;
    }
    uint16_t* vb = values + (blk * (kQ / 2) + j / 2) * s.dim * 2 + j % 2;  // [8, D, 2]
    for (int64_t d = 0; d < s.dim; ++d) vb[2 * d] = v[d];
  }
}

}  // namespace

at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& lengths, int64_t heads,
                             double scale) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 3 && qkv.is_contiguous(),
              "qkv must be contiguous bf16 [B, T, 3 * H * D]");
  const int64_t rows = qkv.size(0), tokens = qkv.size(1);
  TORCH_CHECK(heads > 0 && qkv.size(2) % (3 * heads) == 0, "qkv's width is not 3 * H * D");
  const int64_t dim = qkv.size(2) / (3 * heads);
  TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, "head_dim must be 32, 64 or 128");
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.dim() == 1 &&
                  lengths.size(0) == rows && lengths.is_contiguous(),
              "lengths must be int32 [B]");
  const int32_t* len = lengths.data_ptr<int32_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(len[b] >= 1 && len[b] <= tokens, "row ", b, " has length ", len[b]);
  const Shape s{rows, tokens, heads, dim, (tokens + kQ - 1) / kQ};
  const int64_t width = s.blocks * kQ, slab = width * dim;  // one (row, head)'s packed keys
  auto out = at::empty({rows, tokens, heads * dim}, qkv.options());
  auto keys = at::empty({rows * heads * slab}, qkv.options());
  auto values = at::empty({rows * heads * slab}, qkv.options());
  const auto* q = reinterpret_cast<const uint16_t*>(qkv.data_ptr<c10::BFloat16>());
  auto* kd = reinterpret_cast<uint16_t*>(keys.data_ptr<c10::BFloat16>());
  auto* vd = reinterpret_cast<uint16_t*>(values.data_ptr<c10::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t b = 0; b < rows; ++b)  // padding rows: finite, for the layers after
    std::memset(od + (b * tokens + len[b]) * heads * dim, 0,
                (tokens - len[b]) * heads * dim * sizeof(uint16_t));
  parallel_chunks(rows * heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      pack_head(q, s, i / heads, i % heads, len[i / heads], kd + i * slab, vd + i * slab);
  });

  std::vector<int64_t> items;  // (row, head, first query) as one index: row-major
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r0 = 0; r0 < len[b]; r0 += kQ) items.push_back((b * heads + h) * width + r0);
  const float fscale = static_cast<float>(scale);
  parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores;
    thread_local std::vector<uint16_t> probs;
    scores.resize(kQ * width);
    probs.resize(kQ * width);
    for (int64_t idx = i0; idx < i1; ++idx) {
      const int64_t bh = items[idx] / width, r0 = items[idx] % width;
      const int64_t b = bh / heads, h = bh % heads, length = len[b];
      const int64_t n = std::min(kQ, length - r0), blocks = (length + kQ - 1) / kQ;
      const uint16_t* kb = kd + bh * slab;
      const uint16_t* vb = vd + bh * slab;
      const int32_t* qrow[kQ];
      for (int64_t r = 0; r < kQ; ++r) {
        const int64_t t = r0 + std::min(r, n - 1);  // rows past n repeat the last one
        qrow[r] = reinterpret_cast<const int32_t*>(q + ((b * tokens + t) * 3 * heads + h) * dim);
      }
      int64_t blk = 0;
      for (; blk + 2 <= blocks; blk += 2) {
        score_tile<2>(kb, dim, qrow, blk, scores.data(), width);
        score_tile<2>(kb, dim, qrow + 8, blk, scores.data() + 8 * width, width);
      }
      if (blk < blocks) {
        score_tile<1>(kb, dim, qrow, blk, scores.data(), width);
        score_tile<1>(kb, dim, qrow + 8, blk, scores.data() + 8 * width, width);
      }
      float inv_sum[kQ];
      for (int64_t r = 0; r < n; ++r)
        inv_sum[r] = 1.f / exp_row(scores.data() + r * width, probs.data() + r * width, 0, 0,
                                   length, blocks * kQ, fscale);
      uint16_t* o = od + ((b * tokens + r0) * heads + h) * dim;
      const int64_t ldo = heads * dim;
      switch (dim) {
        case 32: pv_rows<2>(vb, probs.data(), width, inv_sum, blocks, n, o, ldo); break;
        case 64: pv_rows<4>(vb, probs.data(), width, inv_sum, blocks, n, o, ldo); break;
        default: pv_rows<8>(vb, probs.data(), width, inv_sum, blocks, n, o, ldo); break;
      }
    }
  });
  return out;
}

#else

at::Tensor encoder_attention(const at::Tensor&, const at::Tensor&, int64_t, double) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

#endif
