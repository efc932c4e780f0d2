// Causal attention of prompt spans over their sequences' keys in the paged cache, with
// AVX512-BF16.
//
// Span s's queries (rows offset .. offset + length - 1 of q) sit at positions start ..
// start + length - 1 and attend keys 0 .. their own position (within a sliding window when
// given), read through the span's block table. rope_and_cache has already stored the span's
// own keys, so a prompt and its cached prefix are read alike. The cache keeps keys as
// [D/2, 16, 2] per block and head and values as [8, D, 2] (see PagedKVCache): the operand
// layouts of VDPBF16PS, with keys as output columns. Each work item, a (span, query head,
// block of 16 queries), computes its score rows in tiles of 8 rows x 2 key blocks, then
// P = e^(s - max) per row, rounded to bf16, and P.V divided by the row's float sum of P, as
// torch's flash kernel also does.
// Items of every span share one parallel region, longest first, taken one at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kQ = 16;  // queries per work item; positions per cache block

struct Geometry {
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  CacheStrides at;  // where each (block, head) slab of the caches starts
  int64_t dim, heads, groups;
};

// out[i][c0 .. c0 + 64) = P[i] . V / sum[i] over the key pairs of blocks [b0, b1) up to
// position `last`, for R query rows (P unnormalized; inv_sum[i] = 1 / sum[i]). The pair
// holding `last` and `last + 1` (when last is even) keeps only last's half: position last + 1
// may hold a stale value, and 0 * NaN is NaN.
template <int R>
inline void pv_tile(const Geometry& g, int64_t h, const int32_t* table, const uint16_t* probs,
                    int64_t ldp, const float* inv_sum, int64_t b0, int64_t b1, int64_t last,
                    int64_t c0, uint16_t* out, int64_t ldo) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* vb = g.v_cache + g.at.of(table[b], h);  // [8, D, 2]
    const int64_t pairs = b + 1 < b1 ? kQ / 2 : (last - b * kQ) / 2 + 1;
    for (int64_t jp = 0; jp < pairs; ++jp) {
      const __mmask32 keep =
          b + 1 == b1 && jp == pairs - 1 && (last - b * kQ) % 2 == 0 ? 0x55555555u : 0xFFFFFFFFu;
      __m512bh vv[4];
      for (int c = 0; c < 4; ++c)
        vv[c] = (__m512bh)_mm512_maskz_loadu_epi16(keep, vb + (jp * g.dim + c0 + c * 16) * 2);
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, probs + i * ldp + b * kQ + 2 * jp, sizeof(pair));
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv[c], pb);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512 inv = _mm512_set1_ps(inv_sum[i]);
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + c0 + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][c], inv)));
  }
}

// Scores of 8 query rows (qrow: their q, as bf16 pairs) against key blocks [b, b + NB), unscaled,
// into scores[i][b * 16 ...]. Each key load feeds 8 products and each broadcast of q NB: with
// 16 rows x 1 block a broadcast fed one, and the loop fell short of VDPBF16PS's peak
// (figures in bench/results/LOG.md).
template <int NB>
inline void score_tile(const Geometry& g, int64_t h, const int32_t* table,
                       const int32_t* const* qrow, int64_t pairs, int64_t b, float* scores,
                       int64_t width) {
  __m512 acc[8][NB];
  const uint16_t* kb[NB];
  for (int j = 0; j < NB; ++j) kb[j] = g.k_cache + g.at.of(table[b + j], h);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh kv[NB];
    for (int j = 0; j < NB; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kb[j] + p * kQ * 2);
    for (int i = 0; i < 8; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qrow[i][p]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], kv[j], qb);
    }
  }
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(scores + i * width + (b + j) * kQ, acc[i][j]);
}

struct Item {
  int64_t span, head, r0, cost;
};

#ifdef INFER_AMX
// The same item with AMX tiles (Intel since Sapphire Rapids). The caches' layouts are the
// tiles' too: a key block's [D/2, 16, 2] is a 16-key operand per 32 dims of the query rows,
// and a value block's [8, D, 2] an 8-pair operand per 16 output columns. Scores for a key
// block are one 16 x 16 tile; P = e^(s - max), unnormalized, in bf16; P.V runs 64 output
// columns at a time in four accumulator tiles, each block's P a 16-key operand, and divides by
// the row's sum at the end. The last block's values past the item's last query are
// zeroed in a copy (P is 0 there, but 0 * NaN is NaN).

struct AmxItem {
  const uint16_t* q;  // the item's first query row, this head
  int64_t q_stride;   // elements between query rows
  const int32_t* table;
  int64_t h, rows, b0, b1, last;
};

void amx_attention(const Geometry& g, const AmxItem& it, float* scores, uint16_t* probs,
                   int64_t width, float scale, int64_t start_row_pos, int64_t window,
                   uint16_t* out, int64_t out_stride) {
  const int m = static_cast<int>(it.rows);
  // Scores, four key blocks at a time (independent accumulators tmm2-5, so the tile unit
  // overlaps them): tmm0 = Q (32 dims) times K blocks (16 pairs x 16 keys, tmm1 / tmm6).
  configure_tiles({{m, 64}, {16, 64}, {m, 64}, {m, 64}, {m, 64}, {m, 64}, {16, 64}});
  const auto key_block = [&](int64_t b) {
    return g.k_cache + g.at.of(it.table[b], it.h);
  };
  int64_t b = it.b0;
  for (; b + 4 <= it.b1; b += 4) {
    const uint16_t* kb[4] = {key_block(b), key_block(b + 1), key_block(b + 2), key_block(b + 3)};
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t d = 0; d < g.dim; d += 32) {
      _tile_loadd(0, it.q + d, it.q_stride * 2);
      _tile_loadd(1, kb[0] + d * kQ, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(6, kb[1] + d * kQ, 64);
      _tile_dpbf16ps(3, 0, 6);
      _tile_loadd(1, kb[2] + d * kQ, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(6, kb[3] + d * kQ, 64);
      _tile_dpbf16ps(5, 0, 6);
    }
    _tile_stored(2, scores + b * kQ, width * 4);
    _tile_stored(3, scores + (b + 1) * kQ, width * 4);
    _tile_stored(4, scores + (b + 2) * kQ, width * 4);
    _tile_stored(5, scores + (b + 3) * kQ, width * 4);
  }
  for (; b < it.b1; ++b) {
    _tile_zero(2);
    for (int64_t d = 0; d < g.dim; d += 32) {
      _tile_loadd(0, it.q + d, it.q_stride * 2);
      _tile_loadd(1, key_block(b) + d * kQ, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, scores + b * kQ, width * 4);
  }
  // P = e^((s - max) scale) in bf16 over each row's keys, 0 elsewhere; normalized at the end.
  const int64_t k0 = it.b0 * kQ, k1 = it.b1 * kQ;
  float inv_sum[kQ];
  for (int64_t r = 0; r < it.rows; ++r) {
    const int64_t pos = start_row_pos + r;
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    inv_sum[r] = 1.f / exp_row(scores + r * width, probs + r * width, k0, first, pos + 1, k1,
                               scale);
  }
  // P.V: tmm0-3 accumulate 64 output columns, tmm4 = P (16 keys), tmm5 / tmm6 = V (8 pairs
  // x 16 columns).
  alignas(64) uint16_t tail[kQ / 2 * 256 * 2];  // the last block's values, head_dim <= 256
  alignas(64) float acc[kQ][64];
  const uint16_t* vlast = g.v_cache + g.at.of(it.table[it.b1 - 1], it.h);
  const int64_t keep = it.last - (it.b1 - 1) * kQ + 1;  // positions of the last block in use
  std::memcpy(tail, vlast, kQ * g.dim * sizeof(uint16_t));
  for (int64_t j = keep; j < kQ; ++j)
    for (int64_t d = 0; d < g.dim; ++d) tail[(j / 2 * g.dim + d) * 2 + j % 2] = 0;
  configure_tiles({{m, 64}, {m, 64}, {m, 64}, {m, 64}, {m, 32}, {8, 64}, {8, 64}});
  for (int64_t c0 = 0; c0 < g.dim; c0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = it.b0; b < it.b1; ++b) {
      const uint16_t* vb = b + 1 == it.b1
                               ? tail
                               : g.v_cache + g.at.of(it.table[b], it.h);
      _tile_loadd(4, probs + b * kQ, width * 2);
      _tile_loadd(5, vb + c0 * 2, g.dim * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, vb + (c0 + 16) * 2, g.dim * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vb + (c0 + 32) * 2, g.dim * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, vb + (c0 + 48) * 2, g.dim * 4);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, &acc[0][0], sizeof(acc[0]));
    _tile_stored(1, &acc[0][16], sizeof(acc[0]));
    _tile_stored(2, &acc[0][32], sizeof(acc[0]));
    _tile_stored(3, &acc[0][48], sizeof(acc[0]));
    for (int64_t r = 0; r < it.rows; ++r) {
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(out + r * out_stride + c0 + c * 16),
            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[r][c * 16]), inv)));
    }
  }
  _tile_release();
}
#endif

}  // namespace

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tables,
                             const at::Tensor& spans, double scale, int64_t window,
                             at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "paged_prefill_attention takes bf16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [N, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be a contiguous q-sized");
  const int64_t heads = q.size(1), dim = q.size(2);
  const CacheStrides at = cache_strides(k_cache, v_cache);
  TORCH_CHECK(k_cache.size(2) * 2 == dim && k_cache.size(3) == kQ,
              "caches must be [blocks, kv_heads, D / 2, 16, 2] and [blocks, kv_heads, 8, D, 2]");
  const int64_t kv = k_cache.size(1);
  TORCH_CHECK(heads % kv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(dim % 64 == 0, "head_dim must be a multiple of 64");
  TORCH_CHECK(tables.scalar_type() == at::kInt && spans.scalar_type() == at::kInt &&
                  tables.dim() == 2 && tables.is_contiguous() && spans.dim() == 2 &&
                  spans.size(1) == 3 && spans.size(0) == tables.size(0) && spans.is_contiguous(),
              "tables must be int32 [S, max_blocks] and spans int32 [S, 3]");
  const int64_t n_spans = spans.size(0), max_blocks = tables.size(1);
  const int32_t* info = spans.data_ptr<int32_t>();  // offset, length, start
  std::vector<Item> items;
  for (int64_t sp = 0; sp < n_spans; ++sp) {
    const int64_t offset = info[3 * sp], length = info[3 * sp + 1], start = info[3 * sp + 2];
    TORCH_CHECK(offset >= 0 && length >= 0 && start >= 0 && offset + length <= q.size(0) &&
                    (start + length + kQ - 1) / kQ <= max_blocks,
                "span ", sp, " lies outside q or its block table");
    for (int64_t r0 = 0; r0 < length; r0 += kQ) {
      const int64_t last = start + std::min(r0 + kQ, length) - 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + r0 - window + 1) : 0;
      for (int64_t hq = 0; hq < heads; ++hq) items.push_back({sp, hq, r0, last + 1 - lo});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  int64_t work = 0;
  for (const Item& item : items) work += item.cost * kQ * dim;

  const Geometry g{reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>()),
                   at, dim, heads, heads / kv};
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int32_t* table_base = tables.data_ptr<int32_t>();
  const int64_t pairs = dim / 2, width = max_blocks * kQ;
  const float fscale = static_cast<float>(scale);
  const bool amx = use_amx() && dim <= 256;

  auto run = [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores;
    thread_local std::vector<uint16_t> probs;
    scores.resize(kQ * width);
    probs.resize(kQ * width);
    for (int64_t idx = i0; idx < i1; ++idx) {
      const Item& item = items[idx];
      const int64_t offset = info[3 * item.span], length = info[3 * item.span + 1];
      const int64_t start = info[3 * item.span + 2], r0 = item.r0, hq = item.head;
      const int32_t* table = table_base + item.span * max_blocks;
      const int64_t h = hq / g.groups, rows = std::min(kQ, length - r0);
      const int64_t last = start + r0 + rows - 1;  // the block's last query position
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + r0 - window + 1) : 0;
      const int64_t b0 = lo / kQ, b1 = last / kQ + 1;  // key blocks [b0, b1)
#ifdef INFER_AMX
      if (amx) {
        const AmxItem it{qd + (offset + r0) * q.stride(0) + hq * dim, q.stride(0), table, h, rows,
                         b0, b1, last};
        amx_attention(g, it, scores.data(), probs.data(), width, fscale, start + r0, window,
                      od + ((offset + r0) * heads + hq) * dim, heads * dim);
        continue;
      }
#endif
      const int32_t* qrow[kQ];
      for (int64_t r = 0; r < kQ; ++r) {
        const int64_t row = offset + r0 + std::min(r, rows - 1);
        qrow[r] = reinterpret_cast<const int32_t*>(qd + row * q.stride(0) + hq * dim);
      }
      // Scores: 8 query rows x 2 key blocks of accumulators at a time, both halves of the
      // rows while the blocks are in L1.
      float* const rows_lo = scores.data();
      float* const rows_hi = scores.data() + 8 * width;
      int64_t b = b0;
      for (; b + 2 <= b1; b += 2) {
        score_tile<2>(g, h, table, qrow, pairs, b, rows_lo, width);
        score_tile<2>(g, h, table, qrow + 8, pairs, b, rows_hi, width);
      }
      if (b < b1) {
        score_tile<1>(g, h, table, qrow, pairs, b, rows_lo, width);
        score_tile<1>(g, h, table, qrow + 8, pairs, b, rows_hi, width);
      }
      // P = e^((s - max) scale) in bf16 over each row's own keys, zero outside them, in one
      // pass; P.V divides by the row's sum (before: three passes, fast_exp's polynomial and a
      // normalized P).
      const int64_t k0 = b0 * kQ, k1 = b1 * kQ;
      float inv_sum[kQ];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = start + r0 + r;
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        inv_sum[r] = 1.f / exp_row(scores.data() + r * width, probs.data() + r * width, k0,
                                   first, pos + 1, k1, fscale);
      }
      // P.V: 4 rows x 64 columns of accumulators at a time.
      for (int64_t r = 0; r < rows; r += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - r);
        const uint16_t* pr = probs.data() + r * width;
        uint16_t* orow = od + ((offset + r0 + r) * heads + hq) * dim;
        const float* inv = inv_sum + r;
        const int64_t ldo = heads * dim;
        for (int64_t c0 = 0; c0 < dim; c0 += 64) {
          switch (nr) {
            case 4: pv_tile<4>(g, h, table, pr, width, inv, b0, b1, last, c0, orow, ldo); break;
            case 3: pv_tile<3>(g, h, table, pr, width, inv, b0, b1, last, c0, orow, ldo); break;
            case 2: pv_tile<2>(g, h, table, pr, width, inv, b0, b1, last, c0, orow, ldo); break;
            default: pv_tile<1>(g, h, table, pr, width, inv, b0, b1, last, c0, orow, ldo); break;
          }
        }
      }
    }
  };
  // A short span (a chat prompt: tens of tokens) is a few microseconds of work per head:
  // less than waking the second thread, so it runs in this one.
  const auto n_items = static_cast<int64_t>(items.size());
  if (work < (int64_t{1} << 23)) {
    run(0, n_items);
  } else {
    parallel_chunks(n_items, 1, run);
  }
}

#else

void paged_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, int64_t,
                             at::Tensor&) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

#endif
