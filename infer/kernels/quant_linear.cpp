// Linear layers over quantized weights, read as they are: AVX512-VNNI integer dot products.
//
// A weight is one uint8 tensor (packed by infer/models/quant.py): a 128-byte header (magic,
// bits, G, S, N, K, the offsets of sc and sup, which of s and o sc holds), then
//   q    per 16 output columns, every k: unsigned 8-bit values [K/4][16][4] (four k's of a
//        column in one 32-bit lane, VPDPBUSD's operand), or 4-bit values [K/8][16][4] whose
//        low nibbles are k 0-3 and high nibbles k 4-7 of each eight, or 6-bit values: per
//        sixteen k's their low nibbles as the 4-bit layout has them, then [16][4] bytes
//        holding the top two bits of k 0-3 (bits 0-1), 4-7 (bits 2-3) ... 12-15 (bits 6-7);
//   sc   per 16 columns and group of G k's (16 or 32): int8 scale s and int8 offset o [2][16],
//        or s alone [16] where every o = s (Q6_K), or nothing where s = o = 1 (Q4_0 ... Q8_0);
//   sup  per 16 columns and superblock of S groups: fp16 D and M [2][16].
// The weight is w = D*s*u - M*o: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (S = 1, s = o = 1), Q4_K/Q5_K (S =
// 8, 6-bit s and o) and Q6_K (G = 16, S = 16, M = 32 * D, o = s) are all this formula with
// the file's own numbers, computed exactly in float.
//
// Each row of x is quantized like llama.cpp's Q8 activations: a = d_a * q_a with int8 q_a,
// d_a = max|x| / 127 over a span of k's. Then per row, column and group
//   sum_k w x = D*s * d_a * sum(u q_a) - M*o * d_a * sum(q_a),
// where sum(u q_a) is exact in int32 (VPDPBUSD: four u8 x s8 products per lane). A weight
// with superblocks (the K-quants) shares d_a over a span of up to 8 of its groups, as
// llama.cpp's Q8_K does over 256 k's: s * sum(u q_a) then adds up in int32 over the span and
// turns float once per span. Other weights take d_a per group. A tile of R rows x 32 columns
// keeps its accumulators in registers across K, so each weight load feeds R rows. Every row
// is computed the same way whatever else is in the call: results do not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kMagic = 0x32544E4951;  // "QINT2"
constexpr int64_t kHeader = 128;          // bytes
constexpr int64_t kLanes = 16;
constexpr int64_t kCols = 2;       // 16-column blocks per tile
constexpr int64_t kRows = 4;       // rows per tile
constexpr int64_t kRowBlock = 64;  // rows per pass over the weights
// How far ahead of its loads a tile prefetches its weights (bytes). A tile's columns are
// contiguous streams of a few KB, too short for the hardware prefetcher to ramp up.
constexpr int64_t kAhead = 16384;
// Most groups that share one activation scale (kSpan tiles).
constexpr int64_t kSpanGroups = 8;

enum Act : int { kNone = 0, kSilu = 1, kGelu = 2 };
// How a tile scales (see tile()): x per group, per group with s = o = 1, per span of groups.
enum Mode : int { kPerGroup = 0, kUnit = 1, kSpan = 2 };

struct Layout {
  int64_t bits, group, supers_every, n, k;
  const uint8_t* q;
  const int8_t* sc;
  const at::Half* sup;
  int64_t q_block, sc_block, sup_block;  // bytes / entries per 16-column block
  int64_t sc_group;  // bytes of sc per 16-column block and group: 32 (s, o), 16 (s = o), 0
  int64_t o_at;      // where a group's o is in its sc: 16, or 0 (o = s)
  int64_t groups, supers;
};

Layout layout_of(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 1 && w.is_contiguous() &&
                  w.numel() >= kHeader,
              "a quantized weight is a contiguous uint8 tensor packed by infer.models.quant");
  const auto* base = w.data_ptr<uint8_t>();
  int64_t h[9];
  std::memcpy(h, base, sizeof h);
  TORCH_CHECK(h[0] == kMagic, "not a quantized weight (bad header)");
  Layout l;
  l.bits = h[1];
  l.group = h[2];
  l.supers_every = h[3];
  l.n = h[4];
  l.k = h[5];
  TORCH_CHECK((l.bits == 4 || l.bits == 6 || l.bits == 8) && (l.group == 16 || l.group == 32) &&
                  l.n % kLanes == 0 && l.k % 32 == 0 && l.supers_every > 0,
              "unsupported quantized layout");
  l.groups = l.k / l.group;
  l.supers = (l.groups + l.supers_every - 1) / l.supers_every;
  l.q_block = l.k * kLanes * l.bits / 8;
  TORCH_CHECK(h[8] >= 0 && h[8] <= 2, "unsupported quantized layout");
  l.sc_group = (2 - h[8]) * kLanes;  // h[8]: 0 both stored, 1 o = s, 2 s = o = 1
  l.o_at = h[8] == 0 ? kLanes : 0;
  l.sc_block = l.groups * l.sc_group;
  l.sup_block = l.supers * 2 * kLanes;
  const int64_t blocks = l.n / kLanes;
  TORCH_CHECK(h[6] >= kHeader + blocks * l.q_block && h[7] >= h[6] + blocks * l.sc_block &&
                  w.numel() >= h[7] + blocks * l.sup_block * 2,
              "quantized weight is truncated");
  l.q = base + kHeader;
  l.sc = reinterpret_cast<const int8_t*>(base + h[6]);
  l.sup = reinterpret_cast<const at::Half*>(base + h[7]);
  return l;
}

// Rows of x quantized like llama.cpp's Q8 activations: int8 q (K per row) with one scale d_a
// per span of `per` groups, and sum(q) per group.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsum;
  int64_t k, groups, per, spans;
};

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t group, int64_t per,
                   QuantX& out) {
  out.k = k;
  out.groups = k / group;
  out.per = per;
  out.spans = (out.groups + per - 1) / per;
  out.q.resize(rows * k);
  out.d.resize(rows * out.spans);
  out.bsum.resize(rows * out.groups);
  auto load = [](const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_loadu_ps(p);
    } else {
      return load_bf16(p, 0xFFFF);
    }
  };
  auto row = [&](int64_t r) {
    const T* xr = x + r * k;
    for (int64_t sp = 0; sp < out.spans; ++sp) {
      const int64_t k0 = sp * per * group, k1 = std::min(k, k0 + per * group);
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = k0; i < k1; i += kLanes)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(load(xr + i)));
      const float m = _mm512_reduce_max_ps(amax);
      const float d = m / 127.0f;
      const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
      out.d[r * out.spans + sp] = d;
      for (int64_t g = k0 / group; g < k1 / group; ++g) {
        int32_t total = 0;
        for (int64_t h = 0; h < group / kLanes; ++h) {
          const int64_t i = g * group + h * kLanes;
          const __m512i qi = _mm512_cvt_roundps_epi32(
              _mm512_mul_ps(load(xr + i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          total += _mm512_reduce_add_epi32(qi);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&out.q[r * k + i]),
                           _mm512_cvtsepi32_epi8(qi));
        }
        out.bsum[r * out.groups + g] = static_cast<int16_t>(total);
      }
    }
  };
  if (rows == 1) {
    row(0);
  } else {
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row(r);
    });
  }
}

struct Out {
  void* p;
  int64_t ldo;  // elements per output row
  bool out_float;
  const float* bias;  // at this tile's first column, or nullptr
  Act act;
};

// The 16 columns' 64-byte weight vector of k step `step` (four k's) from a column block's q.
template <int Bits>
inline __m512i weights(const uint8_t* q, int64_t step) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  if constexpr (Bits == 8) {
    return _mm512_loadu_si512(q + step * 64);
  } else if constexpr (Bits == 4) {
    const __m512i v = _mm512_loadu_si512(q + (step >> 1) * 64);
    return (step & 1) ? _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)
                      : _mm512_and_si512(v, nib);
  } else {  // 6 bits: 192 bytes per four steps
    const uint8_t* quad = q + (step >> 2) * 192;
    const __m512i v = _mm512_loadu_si512(quad + ((step >> 1) & 1) * 64);
    const __m512i low = (step & 1) ? _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)
                                   : _mm512_and_si512(v, nib);
    // this step's two top bits to bits 4-5 of each byte (16-bit shifts: the mask drops
    // what crosses from the neighbouring byte)
    const __m512i tops = _mm512_loadu_si512(quad + 128);
    const int shift = 2 * static_cast<int>(step & 3);
    const __m512i high = shift <= 4 ? _mm512_slli_epi16(tops, 4 - shift)
                                    : _mm512_srli_epi16(tops, shift - 4);
    return _mm512_or_si512(low, _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
  }
}

// The dot products of one group: dot[r][c] += sum over its k's of u * q_a (exact, int32).
template <int Bits, int G, int R, int C>
inline void group_dots(const uint8_t* const* q, int64_t g, const int32_t* const* xq,
                       __m512i (&dot)[R][C]) {
  constexpr int kSteps = G / 4;
  constexpr int64_t kGroupBytes = G * kLanes * Bits / 8;  // one block's weights per group
  const uint8_t* qg[C];
  for (int c = 0; c < C; ++c) {
    qg[c] = q[c] + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(qg[c]) + line + kAhead, _MM_HINT_T1);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
  // unrolled, so that each step's nibble and shift are constants
#pragma GCC unroll 16
  for (int st = 0; st < kSteps; ++st) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = weights<Bits>(qg[c], st);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(xq[r][g * kSteps + st]);
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], wv[c], xb);
    }
  }
}

// 16 int8 values from p as floats.
inline __m512 int8_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Rows [0, R) x column blocks [0, C) from block `b0`; x rows from `r0`.
//
// Per group (kPerGroup, kUnit; x has a scale per group): acc += d_a*D*s*dot - M*o*d_a*sum(q_a),
// four float operations per row and column block, on the pipes the dot products use: with
// them a batch's tile ran at ~65% of the CPU's VNNI peak, without them at ~90%. kSpan
// (x scaled per span of groups within a superblock): per group only S += s*dot in int32
// (VPMULLD and an add), and once per span acc += d_a*(D*S - M*sum_g o*sum(q_a)), that sum
// by VPDPWSSD over pairs of groups.
template <int Bits, int G, int R, int C, int Mode>
void tile(const Layout& l, int64_t b0, const QuantX& x, int64_t r0, const Out& o, int64_t orow0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint8_t* q[C];
  const int8_t* sc[C];
  const at::Half* sup[C];
  for (int c = 0; c < C; ++c) {
    q[c] = l.q + (b0 + c) * l.q_block;
    sc[c] = l.sc + (b0 + c) * l.sc_block;
    sup[c] = l.sup + (b0 + c) * l.sup_block;
  }
  const int32_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(&x.q[(r0 + r) * x.k]);
  for (int64_t s0 = 0, sb = 0; s0 < l.groups; s0 += l.supers_every, ++sb) {
    __m512 dv[C], mv[C];
    for (int c = 0; c < C; ++c) {
      const at::Half* d = sup[c] + sb * 2 * kLanes;
      dv[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
      mv[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kLanes)));
    }
    const int64_t g1 = std::min(l.groups, s0 + l.supers_every);
    if constexpr (Mode == kSpan) {
      for (int64_t p0 = s0; p0 < g1; p0 += x.per) {  // the spans of this superblock
        const int64_t p1 = std::min(g1, p0 + x.per);
        __m512i isum[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
        for (int64_t g = p0; g < p1; ++g) {
          __m512i dot[R][C];
          group_dots<Bits, G, R, C>(q, g, xq, dot);
          for (int c = 0; c < C; ++c) {
            const __m512i sv = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc[c] + g * l.sc_group)));
            for (int r = 0; r < R; ++r)
              isum[r][c] = _mm512_add_epi32(isum[r][c], _mm512_mullo_epi32(dot[r][c], sv));
          }
        }
        __m512 sum[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) sum[r][c] = _mm512_cvtepi32_ps(isum[r][c]);
        // sum_g o * sum(q_a), two groups per VPDPWSSD: each lane's (o_g, o_g+1) as int16 pairs
        __m512i mins[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) mins[r][c] = _mm512_setzero_si512();
        for (int64_t g = p0; g < p1; g += 2) {
          __m512i pair[C];
          for (int c = 0; c < C; ++c) {
            const int8_t* o = sc[c] + g * l.sc_group + l.o_at;
            const auto* lo = reinterpret_cast<const __m128i*>(o);
            const auto* hi = reinterpret_cast<const __m128i*>(o + l.sc_group);
            const __m128i a = _mm_loadu_si128(lo), b = _mm_loadu_si128(hi);
            pair[c] = _mm512_cvtepi8_epi16(
                _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
          }
          for (int r = 0; r < R; ++r) {
            int32_t both;
            std::memcpy(&both, &x.bsum[(r0 + r) * x.groups + g], sizeof both);
            const __m512i bs = _mm512_set1_epi32(both);
            for (int c = 0; c < C; ++c) mins[r][c] = _mm512_dpwssd_epi32(mins[r][c], pair[c], bs);
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m512 da = _mm512_set1_ps(x.d[(r0 + r) * x.spans + p0 / x.per]);
          for (int c = 0; c < C; ++c) {
            const __m512 t = _mm512_fnmadd_ps(mv[c], _mm512_cvtepi32_ps(mins[r][c]),
                                              _mm512_mul_ps(dv[c], sum[r][c]));
            acc[r][c] = _mm512_fmadd_ps(t, da, acc[r][c]);
          }
        }
      }
    } else {
      for (int64_t g = s0; g < g1; ++g) {
        __m512i dot[R][C];
        group_dots<Bits, G, R, C>(q, g, xq, dot);
        // the group's scales after its dot products: fewer registers live across them
        __m512 sv[C], ov[C];
        for (int c = 0; c < C; ++c) {
          if constexpr (Mode == kUnit) {  // s = o = 1: D and M are the group's
            sv[c] = dv[c];
            ov[c] = mv[c];
          } else {
            sv[c] = _mm512_mul_ps(dv[c], int8_ps(sc[c] + g * l.sc_group));
            ov[c] = _mm512_mul_ps(mv[c], int8_ps(sc[c] + g * l.sc_group + l.o_at));
          }
        }
        for (int r = 0; r < R; ++r) {
          const float d = x.d[(r0 + r) * x.spans + g];
          const __m512 da = _mm512_set1_ps(d);
          const __m512 ds =
              _mm512_set1_ps(d * static_cast<float>(x.bsum[(r0 + r) * x.groups + g]));
          for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][c]), da),
                                        sv[c], acc[r][c]);
            acc[r][c] = _mm512_fnmadd_ps(ov[c], ds, acc[r][c]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = orow0 + r;
    if (o.act != kNone) {  // columns: 16 gate then the matching 16 up
      const __m512 bg = o.bias ? _mm512_loadu_ps(o.bias) : _mm512_setzero_ps();
      const __m512 bu = o.bias ? _mm512_loadu_ps(o.bias + kLanes) : _mm512_setzero_ps();
      const __m512 gt = _mm512_add_ps(acc[r][0], bg);
      const __m512 y = _mm512_mul_ps(o.act == kSilu ? silu16(gt) : gelu_tanh16(gt),
                                     _mm512_add_ps(acc[r][1], bu));
      if (o.out_float) {
        _mm512_storeu_ps(static_cast<float*>(o.p) + row * o.ldo, y);
      } else {
        auto* dst = static_cast<c10::BFloat16*>(o.p) + row * o.ldo;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(y));
      }
      continue;
    }
    for (int c = 0; c < C; ++c) {
      const __m512 b = o.bias ? _mm512_loadu_ps(o.bias + c * kLanes) : _mm512_setzero_ps();
      const __m512 v = _mm512_add_ps(acc[r][c], b);
      if (o.out_float) {
        _mm512_storeu_ps(static_cast<float*>(o.p) + row * o.ldo + c * kLanes, v);
      } else {
        auto* dst = static_cast<c10::BFloat16*>(o.p) + row * o.ldo + c * kLanes;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

template <int Bits, int G, int C, int Mode>
void rows_tile(int64_t rows, const Layout& l, int64_t b0, const QuantX& x, int64_t r0,
               const Out& o) {
  switch (rows) {
    case 4: return tile<Bits, G, 4, C, Mode>(l, b0, x, r0, o, r0);
    case 3: return tile<Bits, G, 3, C, Mode>(l, b0, x, r0, o, r0);
    case 2: return tile<Bits, G, 2, C, Mode>(l, b0, x, r0, o, r0);
    default: return tile<Bits, G, 1, C, Mode>(l, b0, x, r0, o, r0);
  }
}

template <int Bits, int G, int C>
void mode_tile(int64_t rows, const Layout& l, int64_t b0, const QuantX& x, int64_t r0,
               const Out& o) {
  if (x.per > 1) return rows_tile<Bits, G, C, kSpan>(rows, l, b0, x, r0, o);
  if (l.sc_group == 0) return rows_tile<Bits, G, C, kUnit>(rows, l, b0, x, r0, o);
  return rows_tile<Bits, G, C, kPerGroup>(rows, l, b0, x, r0, o);
}

template <int Bits, int G>
void run_item(int64_t rows, const Layout& l, int64_t b0, int64_t nblocks, const QuantX& x,
              int64_t r0, const Out& o) {
  if (nblocks == 2) return mode_tile<Bits, G, 2>(rows, l, b0, x, r0, o);
  return mode_tile<Bits, G, 1>(rows, l, b0, x, r0, o);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, bool out_float, Act act) {
  const Layout l = layout_of(weight);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or float32");
  TORCH_CHECK(x.size(-1) == l.k, "x's last axis does not match the weight");
  TORCH_CHECK(act == kNone || l.n % (kCols * kLanes) == 0,
              "a gated weight needs a multiple of 32 output features");
  auto x2 = x.reshape({-1, l.k}).contiguous();
  const int64_t rows = x2.size(0);
  // x scaled per span of an even number of groups that divides the weight's superblocks
  // (the K-quants: 8 groups, 256 k's for Q4_K and 128 for Q6_K), else per group
  int64_t per = 1;
  if (l.supers_every % 2 == 0 && l.groups % l.supers_every == 0 && l.sc_group > 0)
    for (int64_t p = 2; p <= std::min(l.supers_every, kSpanGroups); p += 2)
      if (l.supers_every % p == 0) per = p;
  QuantX qx;
  if (x2.scalar_type() == at::kFloat) {
    quantize_rows(x2.data_ptr<float>(), rows, l.k, l.group, per, qx);
  } else {
    quantize_rows(x2.data_ptr<c10::BFloat16>(), rows, l.k, l.group, per, qx);
  }
  const int64_t width = act == kNone ? l.n : l.n / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  // float32 activations get float32 outputs (a float32 model); bf16 ones bf16 unless asked.
  out_float = out_float || x.scalar_type() == at::kFloat;
  auto out = at::empty(sizes, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == l.n, "bias must be [out_features]");
  }
  const int64_t blocks = l.n / kLanes;
  const int64_t tiles = (blocks + kCols - 1) / kCols;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  auto work = [&](int64_t i, int64_t) {
    const int64_t t = i % tiles, rb = i / tiles;
    const int64_t b0 = t * kCols, nblocks = std::min(kCols, blocks - b0);
    const int64_t col = b0 * kLanes;
    const int64_t out_col = act == kNone ? col : col / 2;
    const int64_t elem = out_float ? 4 : 2;
    Out o{static_cast<char*>(out.data_ptr()) + out_col * elem, width, out_float,
          b.defined() ? b.data_ptr<float>() + col : nullptr, act};
    const int64_t r1 = std::min(rows, (rb + 1) * kRowBlock);
    for (int64_t r = rb * kRowBlock; r < r1; r += kRows) {
      const int64_t nr = std::min(kRows, r1 - r);
      if (l.bits == 4) {
        if (l.group == 32) run_item<4, 32>(nr, l, b0, nblocks, qx, r, o);
        else run_item<4, 16>(nr, l, b0, nblocks, qx, r, o);
      } else if (l.bits == 6) {
        if (l.group == 32) run_item<6, 32>(nr, l, b0, nblocks, qx, r, o);
        else run_item<6, 16>(nr, l, b0, nblocks, qx, r, o);
      } else {
        if (l.group == 32) run_item<8, 32>(nr, l, b0, nblocks, qx, r, o);
        else run_item<8, 16>(nr, l, b0, nblocks, qx, r, o);
      }
    }
  };
  parallel_owned(tiles * row_blocks, work);
  return out;
}

}  // namespace

bool has_quant_linear() { return true; }

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool out_float) {
  return linear(x, weight, bias, out_float, kNone);
}

at::Tensor quant_gated_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, bool gelu) {
  return linear(x, weight, bias, false, gelu ? kGelu : kSilu);
}

#else  // no AVX512-VNNI: quantized weights are dequantized at load instead

bool has_quant_linear() { return false; }

at::Tensor quant_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                        bool) {
  TORCH_CHECK(false, "this CPU has no AVX512-VNNI");
}

at::Tensor quant_gated_linear(const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "this CPU has no AVX512-VNNI");
}

#endif
