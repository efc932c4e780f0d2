// Linear layers over quantized weights, read as they are: integer dot products on AVX512-VNNI
// (VPDPBUSD on 512 bits), AVX-VNNI (its VEX form on 256 bits) or AVX2 (VPMADDUBSW then
// VPMADDWD).
//
// A weight is one uint8 tensor (packed by infer/models/quant.py): a 128-byte header (magic,
// bits, G, S, N, K, the offsets of sc and sup, which of s and o sc holds, whether o = s with
// M = 32 D, the offset of cc), then
//   q    per 16 output columns, every k: unsigned 8-bit values [K/4][16][4] (four k's of a
//        column in one 32-bit lane, VPDPBUSD's operand), or 4-bit values [K/8][16][4] whose
//        low nibbles are k 0-3 and high nibbles k 4-7 of each eight, or 6-bit values: per
//        sixteen k's their low nibbles as the 4-bit layout has them, then [16][4] bytes
//        holding the top two bits of k 0-3 (bits 0-1), 4-7 (bits 2-3) ... 12-15 (bits 6-7);
//   sc   per 16 columns and group of G k's (16 or 32): int8 scale s and int8 offset o [2][16],
//        or s alone [16] where every o = s (Q6_K), or nothing where s = o = 1 (Q4_0 ... Q8_0);
//   sup  per 16 columns and superblock of S groups: fp16 D and M [2][16];
//   cc   where o = s and M = 32 D (Q6_K): per 16 columns and superblock, int32
//        C = 128 sum_k s (u - 32) [16] (see tile(), kSpanFold).
// The weight is w = D*s*u - M*o: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (S = 1, s = o = 1), Q4_K/Q5_K (S =
// 8, 6-bit s and o) and Q6_K (G = 16, S = 16, M = 32 * D, o = s) are all this formula with
// the file's own numbers, computed exactly in float.
//
// Each row of x is quantized like llama.cpp's Q8 activations: a = d_a * q_a with int8 q_a,
// d_a = max|x| / 127 over a span of k's. Then per row, column and group
//   sum_k w x = D*s * d_a * sum(u q_a) - M*o * d_a * sum(q_a),
// where sum(u q_a) is exact in int32 (VPDPBUSD: four u8 x s8 products per lane). A weight
// with superblocks (the K-quants) shares d_a over a span of 256 k's, as llama.cpp's Q8_K
// does (8 groups of Q4_K, 16 of Q6_K): s * sum(u q_a) then adds up over the span and turns
// float once per span. Other weights take d_a per group. A tile of R rows x 32 columns
// keeps its accumulators in registers across K, so each weight load feeds R rows. Every row
// is computed the same way whatever else is in the call: results do not depend on the batch.
//
// Where the CPU has AMX, K-quant calls of 32 rows or more (16 for 6-bit weights) take their
// integer sums from AMX tiles instead (amx_span): the same numbers by another road, see there.
//
// Each 32-bit lane holds one column's sums, so the arithmetic never crosses lanes: a vector
// of 8 lanes (AVX-VNNI) computes each column with the same operations, in the same order, as
// one of 16 (AVX512), and both builds give the same bits. AVX2 without VNNI adds s * sum(u q_a)
// over a span in int32 (see tile()), where the others add it in float: every term is an
// integer, so the float sum is the same number while it stays under 2^24 in magnitude, and
// only beyond that do the builds' bits part (AVX2's sum is then the exact one). On 256 bits a
// tile's unit is half a 16-column block: its q, sc and sup are the block's at an offset of 8
// lanes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define INFER_QUANT_BITS 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INFER_QUANT_BITS 256
#endif

#ifdef INFER_QUANT_BITS
#include <immintrin.h>

#if INFER_QUANT_BITS == 512 && defined(INFER_AMX) && defined(__AMX_INT8__)
#define INFER_QUANT_AMX 1
#endif

namespace {

constexpr int64_t kMagic = 0x32544E4951;  // "QINT2"
constexpr int64_t kHeader = 128;          // bytes
constexpr int64_t kPartsMagic = 0x5354524150494E51;  // "QNIPARTS": a weight of parts
constexpr int64_t kLanes = 16;            // columns per block of the packed layout
constexpr int64_t kCols = 2;              // 16-column blocks per work item
constexpr int64_t kRows = 4;              // rows per tile
constexpr int64_t kWideRows = 8;          // rows per tile of one unit (see wide_tile)
constexpr int64_t kRowBlock = 64;         // rows per pass over the weights
// How far ahead of its loads a tile prefetches its weights (bytes). A tile's columns are
// contiguous streams of a few KB, too short for the hardware prefetcher to ramp up.
constexpr int64_t kAhead = 16384;
// Most k's that share one activation scale (kSpan tiles): llama.cpp's Q8_K block.
constexpr int64_t kSpanK = 256;

enum Act : int { kNone = 0, kSilu = 1, kGelu = 2 };
// How a tile scales (see tile()): x per group, per group with s = o = 1, per span of groups.
enum Mode : int { kPerGroup = 0, kUnit = 1, kSpan = 2, kSpanFold = 3 };

// The integer operations weights() takes, on 8 lanes: the 256-bit build's V has them, and so
// does the 512-bit build's Y.
struct Ops8 {
  using I = __m256i;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I set1_8(char v) { return _mm256_set1_epi8(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I sub8(I a, I b) { return _mm256_sub_epi8(a, b); }
  static I srli16(I a, unsigned n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, unsigned n) { return _mm256_slli_epi16(a, n); }
};

#if INFER_QUANT_BITS == 512
// The vector operations a tile uses, on 16 lanes.
struct V {
  static constexpr int64_t kWidth = 16;
  static constexpr bool kPairs16 = false;  // dot() is one instruction: no int16 pair sums
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static F zerof() { return _mm512_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void storei(void* p, I v) { _mm512_storeu_si512(p, v); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I set1_8(char v) { return _mm512_set1_epi8(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I sub8(I a, I b) { return _mm512_sub_epi8(a, b); }
  static I srli16(I a, unsigned n) { return _mm512_srli_epi16(a, n); }
  static I slli16(I a, unsigned n) { return _mm512_slli_epi16(a, n); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  // acc + the sums of four u8 x s8 products per lane, exact
  template <int Bits>
  static I dot(I acc, I u, I x) {
    return _mm512_dpbusd_epi32(acc, u, x);
  }
  // acc + the sums of two s16 x s16 products per lane
  static I dot16(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  // unused here (kPairs16): the 8-lane trait's int16 pair sums, for one group_dots()
  static I pairs16(I u, I x) { return _mm512_maddubs_epi16(u, x); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I widen16(I a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  // 16 int8 as int32 lanes
  static I int8(const int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // lane i: the int16 pair (a[i], b[i])
  static I pairs(const int8_t* a, const int8_t* b) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(x, y), _mm_unpacklo_epi8(x, y)));
  }
  static F tof(I a) { return _mm512_cvtepi32_ps(a); }
  static F half(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F addf(F a, F b) { return _mm512_add_ps(a, b); }
  static F subf(F a, F b) { return _mm512_sub_ps(a, b); }
  static I slli32(I a, unsigned n) { return _mm512_slli_epi32(a, n); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F silu(F x) { return silu16(x); }
  static F gelu(F x) { return gelu_tanh16(x); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, F v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int i = 0; i < 16; ++i) {  // subnormals to zero, as VCVTNEPS2BF16
      if (std::fpclassify(f[i]) == FP_SUBNORMAL) f[i] = std::copysign(0.0f, f[i]);
      p[i] = from_float<c10::BFloat16>(f[i]);
    }
#endif
  }
  // x's first 16 values as float
  static F loadx(const float* p) { return _mm512_loadu_ps(p); }
  static F loadx(const c10::BFloat16* p) { return load_bf16(p, 0xFFFF); }
  static float hmax(F a) { return _mm512_reduce_max_ps(a); }  // the largest lane
  static F absf(F a) { return _mm512_abs_ps(a); }
  static F maxf(F a, F b) { return _mm512_max_ps(a, b); }
  // round to nearest even; store as int8 (|v| <= 127) and return the lanes' sum
  static int32_t to_int8(F v, int8_t* out) {
    const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q));
    return _mm512_reduce_add_epi32(q);
  }
};
// The operations group_dots() takes on 8 lanes for one row reading one stream (see there):
// EVEX VPDPBUSD on 256 bits.
struct Y : Ops8 {
  static I dot(I acc, I u, I x) { return _mm256_dpbusd_epi32(acc, u, x); }
};
#else
// The same operations on 8 lanes: AVX2, with AVX-VNNI's dot products where the CPU has them.
struct V : Ops8 {
  static constexpr int64_t kWidth = 8;
#if defined(__AVXVNNI__)
  static constexpr bool kPairs16 = false;
#else
  // dot() is VPMADDUBSW, VPMADDWD and VPADDD: a group of 4-bit weights adds VPMADDUBSW's int16
  // pair sums (pairs16, add16) and widens them once (widen16), see group_dots().
  static constexpr bool kPairs16 = true;
#endif
  using F = __m256;
  static F zerof() { return _mm256_setzero_ps(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  template <int Bits>
  static I dot(I acc, I u, I x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
    // VPMADDUBSW adds two u8 x s8 products in int16 with saturation: exact while u < 128
    // (|q_a| <= 127). 8-bit weights go by nibbles: u q = 16 (u >> 4) q + (u & 15) q.
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (Bits == 8) {
      const __m256i nib = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(u, nib), x);
      const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), nib), x);
      const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(lo, ones),
                                           _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4));
      return _mm256_add_epi32(acc, sum);
    } else {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
    }
#endif
  }
  static I pairs16(I u, I x) { return _mm256_maddubs_epi16(u, x); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen16(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I dot16(I acc, I a, I b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  static I int8(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I pairs(const int8_t* a, const int8_t* b) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
    const __m128i y = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
  }
  static F tof(I a) { return _mm256_cvtepi32_ps(a); }
  static F half(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  static F subf(F a, F b) { return _mm256_sub_ps(a, b); }
  static I slli32(I a, unsigned n) { return _mm256_slli_epi32(a, n); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F silu(F x) { return silu8(x); }
  static F gelu(F x) { return gelu_tanh8(x); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, F v) {
    // round to nearest even, subnormals to zero, as VCVTNEPS2BF16 (no NaN reaches here)
    __m256i u = _mm256_castps_si256(v);
    const __m256i tiny = _mm256_cmpeq_epi32(
        _mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
    u = _mm256_andnot_si256(_mm256_and_si256(tiny, _mm256_set1_epi32(0x7FFFFFFF)), u);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static F loadx(const float* p) { return _mm256_loadu_ps(p); }
  static F loadx(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static float hmax(F a) {  // the largest lane
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static F absf(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static F maxf(F a, F b) { return _mm256_max_ps(a, b); }
  static int32_t to_int8(F v, int8_t* out) {
    const __m256i q = _mm256_cvtps_epi32(
        _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i w = _mm_packs_epi32(lo, hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
    __m128i s = _mm_add_epi32(lo, hi);
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
};
#endif

constexpr int64_t kW = V::kWidth;  // columns per vector: a tile's unit
// Whether weights of `bits` go one unit a pass, in tiles of kWideRows rows where a call has
// that many (a gated call then takes the gate unit's tile, then the up unit's): 6-bit
// weights, whose unpacking costs the most (each weight vector unpacked then feeds twice the
// rows), on every target; and 4-bit weights on AVX2 without VNNI, whose 8 rows of int16 sums
// fit the 16 registers (see group_dots()). With VNNI, 4-bit weights measured no faster so.
constexpr bool wide_tile(int64_t bits) { return bits == 6 || (V::kPairs16 && bits == 4); }
using VI = V::I;
using VF = V::F;

struct Layout {
  int64_t bits, group, supers_every, n, k;
  const uint8_t* q;
  const int8_t* sc;
  const at::Half* sup;
  int64_t q_block, sc_block, sup_block;  // bytes / entries per 16-column block
  int64_t sc_group;  // bytes of sc per 16-column block and group: 32 (s, o), 16 (s = o), 0
  int64_t o_at;      // where a group's o is in its sc: 16, or 0 (o = s)
  bool fold;         // o = s and M = 32 D (Q6_K): w = D s (u - 32)
  const int32_t* cc;  // where fold: C = 128 sum_k s (u - 32) [blocks][supers][16]; or null
  int64_t cc_block;
  int64_t groups, supers;
};

Layout layout_of(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 1 && w.is_contiguous() &&
                  w.numel() >= kHeader,
              "a quantized weight is a contiguous uint8 tensor packed by infer.models.quant");
  const auto* base = w.data_ptr<uint8_t>();
  int64_t h[11];
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
  TORCH_CHECK(h[9] == 0 || (h[9] == 1 && h[8] == 1), "unsupported quantized layout");
  l.fold = h[9] == 1;
  l.sc_block = l.groups * l.sc_group;
  l.sup_block = l.supers * 2 * kLanes;
  const int64_t blocks = l.n / kLanes;
  TORCH_CHECK(h[6] >= kHeader + blocks * l.q_block && h[7] >= h[6] + blocks * l.sc_block &&
                  w.numel() >= h[7] + blocks * l.sup_block * 2,
              "quantized weight is truncated");
  l.q = base + kHeader;
  l.sc = reinterpret_cast<const int8_t*>(base + h[6]);
  l.sup = reinterpret_cast<const at::Half*>(base + h[7]);
  l.cc_block = l.supers * kLanes;
  TORCH_CHECK(h[10] == 0 || (l.fold && h[10] >= h[7] + blocks * l.sup_block * 2 &&
                             w.numel() >= h[10] + blocks * l.cc_block * 4),
              "quantized weight is truncated");
  l.cc = h[10] ? reinterpret_cast<const int32_t*>(base + h[10]) : nullptr;
  return l;
}

// Rows of x quantized like llama.cpp's Q8 activations: int8 q (K per row) with one scale d_a
// per span of `per` groups, and sum(q) per group.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<uint8_t> qu;  // q + 128 as unsigned, where a fold tile of several rows needs it
  std::vector<float> d;
  std::vector<int16_t> bsum;
  int64_t k, groups, per, spans;
};

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t group, int64_t per,
                   bool with_unsigned, QuantX& out) {
  out.k = k;
  out.groups = k / group;
  out.per = per;
  out.spans = (out.groups + per - 1) / per;
  out.q.resize(rows * k);
  out.qu.resize(with_unsigned ? rows * k : 0);
  out.d.resize(rows * out.spans);
  out.bsum.resize(rows * out.groups);
  auto row = [&](int64_t r) {
    const T* xr = x + r * k;
    for (int64_t sp = 0; sp < out.spans; ++sp) {
      const int64_t k0 = sp * per * group, k1 = std::min(k, k0 + per * group);
      VF amax = V::zerof();
      for (int64_t i = k0; i < k1; i += kW) amax = V::maxf(amax, V::absf(V::loadx(xr + i)));
      const float m = V::hmax(amax);
      const float d = m / 127.0f;
      const VF inv = V::set1f(m > 0.0f ? 127.0f / m : 0.0f);
      out.d[r * out.spans + sp] = d;
      for (int64_t g = k0 / group; g < k1 / group; ++g) {
        int32_t total = 0;
        for (int64_t i = g * group; i < (g + 1) * group; i += kW)
          total += V::to_int8(V::mul(V::loadx(xr + i), inv), &out.q[r * k + i]);
        out.bsum[r * out.groups + g] = static_cast<int16_t>(total);
      }
    }
    if (with_unsigned) {  // q + 128
      const auto* q = reinterpret_cast<const uint8_t*>(&out.q[r * k]);
      uint8_t* qu = &out.qu[r * k];
      for (int64_t i = 0; i < k; i += 32)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qu + i),
                            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)),
                                             _mm256_set1_epi8(static_cast<char>(0x80))));
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

// Where a tile writes: out's row 0 at its first column.
struct Out {
  void* p;
  int64_t ldo;  // elements per output row
  bool out_float;
  const float* bias;  // at this tile's first column, or nullptr
  Act act;
  int64_t unit_step = kW;  // columns from one unit's first to the next's (not gated)
  int64_t first_row = 0;   // the x row that p's row 0 holds
};

// A tile's unit of columns (kW of them): its weights, scales and superblock scales.
struct Unit {
  const uint8_t* q;
  const int8_t* sc;
  const at::Half* sup;
  const int32_t* cc;  // the block's fold constants (Layout::cc), or null
  bool stream;  // a pass of up to kRows rows that reads one stream per thread (see linear())
};

// The unit's kW columns' weight vector of k step `step` (four k's) from its q. A block's
// rows of 16 columns are 64 bytes; a unit of 8 reads its half. Signed: u - 32 (6 bits, for
// the fold tiles), as int8.
template <int Bits, typename T = V, bool Signed = false>
inline typename T::I weights(const uint8_t* q, int64_t step) {
  using I = typename T::I;
  const I nib = T::set1_8(0x0F);
  if constexpr (Bits == 8) {
    return T::load(q + step * 64);
  } else if constexpr (Bits == 4) {
    const I v = T::load(q + (step >> 1) * 64);
    return (step & 1) ? T::and_(T::srli16(v, 4), nib) : T::and_(v, nib);
  } else {  // 6 bits: 192 bytes per four steps
    const uint8_t* quad = q + (step >> 2) * 192;
    const I v = T::load(quad + ((step >> 1) & 1) * 64);
    const I low = (step & 1) ? T::and_(T::srli16(v, 4), nib) : T::and_(v, nib);
    // this step's two top bits to bits 4-5 of each byte (16-bit shifts: the mask drops
    // what crosses from the neighbouring byte)
    const I tops = T::load(quad + 128);
    const int shift = 2 * static_cast<int>(step & 3);
    const I high = shift <= 4 ? T::slli16(tops, 4 - shift) : T::srli16(tops, shift - 4);
    const I w = T::or_(low, T::and_(high, T::set1_8(0x30)));
    return Signed ? T::sub8(w, T::set1_8(32)) : w;
  }
}

// The C units' weight vectors of steps st and st + 1 (of one group, from qg).
template <int Bits, int C, bool Signed = false>
inline void step_pair(const uint8_t* const* qg, int st, VI (&lo)[C], VI (&hi)[C]) {
  for (int c = 0; c < C; ++c) {
    lo[c] = weights<Bits, V, Signed>(qg[c], st);
    hi[c] = weights<Bits, V, Signed>(qg[c], st + 1);
  }
}

// The dot products of one group: dot[r][c] = sum over its k's of u * q_a (exact, int32). With
// sp (AVX2 without VNNI: each lane's scale s as an int16 pair (s, s)), s times that: the int16
// pair sums widen by VPMADDWD against sp instead of against ones, so the scale costs nothing.
// Fold (6 bits): the sums of (q_a + 128) (u - 32) instead, x's rows (xq) unsigned.
template <int Bits, int G, int R, int C, bool Fold = false>
inline void group_dots(const Unit* u, int64_t g, const int32_t* const* xq, VI (&dot)[R][C],
                       const VI* sp = nullptr) {
  constexpr int kSteps = G / 4;
  constexpr int64_t kGroupBytes = G * kLanes * Bits / 8;  // one block's weights per group
  const uint8_t* qg[C];
  for (int c = 0; c < C; ++c) {
    qg[c] = u[c].q + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(qg[c]) + line + kAhead, _MM_HINT_T1);
  }
#if INFER_QUANT_BITS == 256
  if constexpr (V::kPairs16 && Bits == 4 && G == 32 && R == 4 && C == 2) {
    // 4 rows x 2 units of Q4_K on AVX2 (a few rows, a gated call's gate and up), written out
    // for the same reason: 8 int16 sums, four nibble vectors, the mask and two temporaries
    // take 15 registers.
    const uint8_t* qa = qg[0];
    const uint8_t* qb = qg[1];
    const int32_t* x0 = xq[0] + g * kSteps; const int32_t* x1 = xq[1] + g * kSteps;
    const int32_t* x2 = xq[2] + g * kSteps; const int32_t* x3 = xq[3] + g * kSteps;
    const VI nib = V::set1_8(0x0F);
    VI a0 = V::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    VI loa, hia, lob, hib, t, t2;
#define HALF(SA, SB, X, OFF, WA, WB) \
    "vpbroadcastd " #OFF "(%[" #X "]), %[t]\n\t" \
    "vpmaddubsw %[t], %[" #WA "], %[t2]\n\t" \
    "vpaddw %[t2], %[" #SA "], %[" #SA "]\n\t" \
    "vpmaddubsw %[t], %[" #WB "], %[t]\n\t" \
    "vpaddw %[t], %[" #SB "], %[" #SB "]\n\t"
#define ROW(SA, SB, X, OFF) HALF(SA, SB, X, OFF, loa, lob) HALF(SA, SB, X, OFF+4, hia, hib)
#define PASS(P) \
    "vpsrlw $4, " #P "*64(%[qa]), %[hia]\n\t" \
    "vpand " #P "*64(%[qa]), %[nib], %[loa]\n\t" \
    "vpand %[nib], %[hia], %[hia]\n\t" \
    "vpsrlw $4, " #P "*64(%[qb]), %[hib]\n\t" \
    "vpand " #P "*64(%[qb]), %[nib], %[lob]\n\t" \
    "vpand %[nib], %[hib], %[hib]\n\t" \
    ROW(a0, b0, x0, P*8) ROW(a1, b1, x1, P*8) ROW(a2, b2, x2, P*8) ROW(a3, b3, x3, P*8)
    asm(PASS(0) PASS(1) PASS(2) PASS(3)
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [b0] "+x"(b0),
          [b1] "+x"(b1), [b2] "+x"(b2), [b3] "+x"(b3), [loa] "=&x"(loa), [hia] "=&x"(hia),
          [lob] "=&x"(lob), [hib] "=&x"(hib), [t] "=&x"(t), [t2] "=&x"(t2)
        : [qa] "r"(qa), [qb] "r"(qb), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3),
          [nib] "x"(nib)
        : "memory");
#undef PASS
#undef ROW
#undef HALF
    const VI sa[4] = {a0, a1, a2, a3}, sb[4] = {b0, b1, b2, b3};
    for (int r = 0; r < R; ++r) {
      dot[r][0] = sp ? V::madd16(sa[r], sp[0]) : V::widen16(sa[r]);
      dot[r][1] = sp ? V::madd16(sb[r], sp[1]) : V::widen16(sb[r]);
    }
    return;
  }
  if constexpr (V::kPairs16 && Bits == 4 && G == 32 && R == 8 && C == 1) {
    // 8 rows of Q4_K on AVX2, written out. The 8 rows' int16 sums, the step
    // pair's two nibble vectors, the mask and one broadcast x take 13 of the 16 registers, and
    // each unpacked weight vector feeds 16 VPMADDUBSW. Written in C++ the same loop kept the
    // sums in memory (GCC 12 spilled them, loading and storing each at every step).
    const uint8_t* q = qg[0];
    const int32_t* x0 = xq[0] + g * kSteps; const int32_t* x1 = xq[1] + g * kSteps;
    const int32_t* x2 = xq[2] + g * kSteps; const int32_t* x3 = xq[3] + g * kSteps;
    const int32_t* x4 = xq[4] + g * kSteps; const int32_t* x5 = xq[5] + g * kSteps;
    const int32_t* x6 = xq[6] + g * kSteps; const int32_t* x7 = xq[7] + g * kSteps;
    const VI nib = V::set1_8(0x0F);
    VI s0 = V::zero(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    VI w, lo, hi, t;
#define ROW(S, X, OFF) \
    "vpbroadcastd " #OFF "(%[" #X "]), %[t]\n\t" \
    "vpmaddubsw %[t], %[lo], %[t]\n\t" \
    "vpaddw %[t], %[" #S "], %[" #S "]\n\t" \
    "vpbroadcastd " #OFF "+4(%[" #X "]), %[t]\n\t" \
    "vpmaddubsw %[t], %[hi], %[t]\n\t" \
    "vpaddw %[t], %[" #S "], %[" #S "]\n\t"
#define PASS(P) \
    "vmovdqu " #P "*64(%[q]), %[w]\n\t" \
    "vpsrlw $4, %[w], %[hi]\n\t" \
    "vpand %[nib], %[w], %[lo]\n\t" \
    "vpand %[nib], %[hi], %[hi]\n\t" \
    ROW(s0, x0, P*8) ROW(s1, x1, P*8) ROW(s2, x2, P*8) ROW(s3, x3, P*8) \
    ROW(s4, x4, P*8) ROW(s5, x5, P*8) ROW(s6, x6, P*8) ROW(s7, x7, P*8)
    asm(PASS(0) PASS(1) PASS(2) PASS(3)
        : [s0] "+x"(s0), [s1] "+x"(s1), [s2] "+x"(s2), [s3] "+x"(s3), [s4] "+x"(s4),
          [s5] "+x"(s5), [s6] "+x"(s6), [s7] "+x"(s7), [w] "=&x"(w), [lo] "=&x"(lo),
          [hi] "=&x"(hi), [t] "=&x"(t)
        : [q] "r"(q), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [x4] "r"(x4),
          [x5] "r"(x5), [x6] "r"(x6), [x7] "r"(x7), [nib] "x"(nib)
        : "memory");
#undef PASS
#undef ROW
    const VI s[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int r = 0; r < R; ++r) dot[r][0] = sp ? V::madd16(s[r], sp[0]) : V::widen16(s[r]);
    return;
  }
#endif
  if constexpr (V::kPairs16 && Bits == 4) {
    // A 4-bit weight times a quantized x is at most 15 * 127, so a VPMADDUBSW pair sum is at
    // most 3810 and a group's (at most 8 steps) at most 30480: it adds in int16, exact, and
    // widens to int32 once, one VPMADDWD a group instead of one a step.
    static_assert(kSteps * 2 * 15 * 127 <= 32767, "a group's pair sums must fit in int16");
    VI sums[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c] = V::zero();
    // Two steps a pass (one load holds both's nibbles). A tile of several rows is not
    // unrolled further: with every step's weights unpacked ahead, 16 registers spill.
    auto pass = [&](int st) {
      VI lo[C], hi[C];
      step_pair<Bits, C>(qg, st, lo, hi);
      for (int r = 0; r < R; ++r) {
        const VI x0 = V::set1(xq[r][g * kSteps + st]);
        for (int c = 0; c < C; ++c) sums[r][c] = V::add16(sums[r][c], V::pairs16(lo[c], x0));
        const VI x1 = V::set1(xq[r][g * kSteps + st + 1]);
        for (int c = 0; c < C; ++c) sums[r][c] = V::add16(sums[r][c], V::pairs16(hi[c], x1));
      }
    };
    if constexpr (R == 1) {
#pragma GCC unroll 8
      for (int st = 0; st < kSteps; st += 2) pass(st);
    } else {
#pragma GCC unroll 1
      for (int st = 0; st < kSteps; st += 2) pass(st);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        dot[r][c] = sp ? V::madd16(sums[r][c], sp[c]) : V::widen16(sums[r][c]);
    return;
  }
  if constexpr (V::kPairs16 && Bits == 6) {
    // A 6-bit weight's pair sums are at most 2 * 63 * 127 (fold: 2 * 32 * 255): two steps' add
    // in int16, exact, and widen once, one VPMADDWD a pair of steps instead of one a step.
    static_assert(2 * 2 * 63 * 127 <= 32767 && 2 * 2 * 32 * 255 <= 32767,
                  "two steps' pair sums must fit in int16");
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = V::zero();
#pragma GCC unroll 8
    for (int st = 0; st < kSteps; st += 2) {
      VI lo[C], hi[C];
      step_pair<Bits, C, Fold>(qg, st, lo, hi);
      for (int r = 0; r < R; ++r) {
        const VI x0 = V::set1(xq[r][g * kSteps + st]);
        const VI x1 = V::set1(xq[r][g * kSteps + st + 1]);
        for (int c = 0; c < C; ++c) {
          const VI p = Fold ? V::add16(V::pairs16(x0, lo[c]), V::pairs16(x1, hi[c]))
                            : V::add16(V::pairs16(lo[c], x0), V::pairs16(hi[c], x1));
          dot[r][c] = V::add(dot[r][c], sp ? V::madd16(p, sp[c]) : V::widen16(p));
        }
      }
    }
    return;
  }
#if INFER_QUANT_BITS == 512
  if constexpr (R == 1 && C == 1 && Bits != 8 && !Fold) {
    if (u[0].stream) {
      // One row reading one stream: the block in its two 256-bit halves (columns 0-7 and
      // 8-15), as the 8-lane builds read it. The same integer sums; one row reads its
      // weights faster so when the memory is fast, while 2-4 rows are bound by their
      // arithmetic and stay on 512 bits (figures in bench/results/LOG.md).
      Y::I lo = Y::zero(), hi = Y::zero();
#pragma GCC unroll 16
      for (int st = 0; st < kSteps; ++st) {
        const Y::I xb = Y::set1(xq[0][g * kSteps + st]);
        lo = Y::dot(lo, weights<Bits, Y>(qg[0], st), xb);
        hi = Y::dot(hi, weights<Bits, Y>(qg[0] + 32, st), xb);
      }
      dot[0][0] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      return;
    }
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) dot[r][c] = V::zero();
  // unrolled, so that each step's nibble and shift are constants
#pragma GCC unroll 16
  for (int st = 0; st < kSteps; ++st) {
    VI wv[C];
    for (int c = 0; c < C; ++c) wv[c] = weights<Bits, V, Fold>(qg[c], st);
    for (int r = 0; r < R; ++r) {
      const VI xb = V::set1(xq[r][g * kSteps + st]);
      for (int c = 0; c < C; ++c)
        dot[r][c] = Fold ? V::template dot<Bits>(dot[r][c], xb, wv[c])
                         : V::template dot<Bits>(dot[r][c], wv[c], xb);
    }
  }
}

// Output row `row` of a tile's C units from their sums: bias, then the gated activation or
// the plain columns.
template <int C>
inline void put_row(const Out& o, int64_t row, const VF* acc) {
  auto put = [&](int64_t col, VF v) {
    if (o.out_float) {
      V::store(static_cast<float*>(o.p) + (row - o.first_row) * o.ldo + col, v);
    } else {
      V::store(static_cast<c10::BFloat16*>(o.p) + (row - o.first_row) * o.ldo + col, v);
    }
  };
  if (o.act != kNone) {  // unit 0 the gate, unit 1 its up (16 columns further in the weight)
    const VF bg = o.bias ? V::loadf(o.bias) : V::zerof();
    const VF bu = o.bias ? V::loadf(o.bias + kLanes) : V::zerof();
    const VF gt = V::addf(acc[0], bg);
    put(0, V::mul(o.act == kSilu ? V::silu(gt) : V::gelu(gt), V::addf(acc[C - 1], bu)));
    return;
  }
  for (int c = 0; c < C; ++c) {
    const VF b = o.bias ? V::loadf(o.bias + c * o.unit_step) : V::zerof();
    put(c * o.unit_step, V::addf(acc[c], b));
  }
}

#if INFER_QUANT_BITS == 256
// The span sums sum_g s * sum(u q_a) of 8 rows and one unit of Q6_K (G = 16) on AVX2, groups
// p0 to p1, written out for the same reason as group_dots()'s 8 rows of Q4_K: the 8 rows' int32
// sums, two unpacked weight vectors, sp, the two masks and two temporaries take 15 of the 16
// registers. Two steps' VPMADDUBSW pair sums add in int16 (at most 2 * 2 * 63 * 127), then
// VPMADDWD against sp (each lane's (s, s)) gives s times them in int32. Fold: x's rows
// unsigned (q_a + 128) and the weights u - 32 (at most 2 * 2 * 255 * 32), the constant 32 in
// the 16th register.
template <bool Fold>
inline void span_q6(const Unit& u, int64_t p0, int64_t p1, int64_t sc_group,
                    const int32_t* const* xq, VI (&sum)[8]) {
  constexpr int64_t kGroupBytes = 16 * kLanes * 6 / 8;  // one block's weights per group
  const VI m0f = V::set1_8(0x0F), m30 = V::set1_8(0x30), m32 = V::set1_8(32);
  const int64_t k = reinterpret_cast<const char*>(xq[1]) - reinterpret_cast<const char*>(xq[0]);
  VI s0 = V::zero(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  for (int64_t g = p0; g < p1; ++g) {
    const uint8_t* q = u.q + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q) + line + kAhead, _MM_HINT_T1);
    const int8_t* sg = u.sc + g * sc_group;
    const VI sp = V::pairs(sg, sg);
    // x's rows are k bytes apart: rows 0-3 from xa, 4-7 from xb (asm takes 30 operands)
    const int32_t* xa = xq[0] + g * 4;
    const int32_t* xb = xq[4] + g * 4;
    VI wa, wb, t1, t2;
    // AT&T order: VPMADDUBSW's unsigned operand is the middle one. MU: the weights unsigned
    // (u), MF: x unsigned and the weights u - 32 (W32 subtracts the 32).
#define MU(X, W) "vpmaddubsw %[" #X "], %[" #W "], %[" #X "]\n\t"
#define MF(X, W) "vpmaddubsw %[" #W "], %[" #X "], %[" #X "]\n\t"
#define W32(W) "vpsubb %[m32], %[" #W "], %[" #W "]\n\t"
#define NONE(W)
#define ROW(M, S, OFF, AT) \
    "vpbroadcastd " #OFF AT ", %[t1]\n\t" M(t1, wa) \
    "vpbroadcastd " #OFF "+4" AT ", %[t2]\n\t" M(t2, wb) \
    "vpaddw %[t2], %[t1], %[t1]\n\t" \
    "vpmaddwd %[sp], %[t1], %[t1]\n\t" \
    "vpaddd %[t1], %[" #S "], %[" #S "]\n\t"
#define ROWS(M, OFF) \
    ROW(M, s0, OFF, "(%[xa])") ROW(M, s1, OFF, "(%[xa],%[k],1)") \
    ROW(M, s2, OFF, "(%[xa],%[k],2)") ROW(M, s3, OFF, "(%[xa],%[k3],1)") \
    ROW(M, s4, OFF, "(%[xb])") ROW(M, s5, OFF, "(%[xb],%[k],1)") \
    ROW(M, s6, OFF, "(%[xb],%[k],2)") ROW(M, s7, OFF, "(%[xb],%[k3],1)")
    // steps 0 and 1: low nibbles of bytes 0-63, top bits 0-1 and 2-3 of bytes 128-191
    // (shifted to bits 4-5); steps 2 and 3: bytes 64-127, top bits 4-5 and 6-7
#define BODY(M, SUB) \
        "vpand (%[q]), %[m0f], %[wa]\n\t" \
        "vpsllw $4, 128(%[q]), %[t1]\n\t" \
        "vpand %[m30], %[t1], %[t1]\n\t" \
        "vpor %[t1], %[wa], %[wa]\n\t" SUB(wa) \
        "vpsrlw $4, (%[q]), %[wb]\n\t" \
        "vpand %[m0f], %[wb], %[wb]\n\t" \
        "vpsllw $2, 128(%[q]), %[t1]\n\t" \
        "vpand %[m30], %[t1], %[t1]\n\t" \
        "vpor %[t1], %[wb], %[wb]\n\t" SUB(wb) \
        ROWS(M, 0) \
        "vpand 64(%[q]), %[m0f], %[wa]\n\t" \
        "vpand 128(%[q]), %[m30], %[t1]\n\t" \
        "vpor %[t1], %[wa], %[wa]\n\t" SUB(wa) \
        "vpsrlw $4, 64(%[q]), %[wb]\n\t" \
        "vpand %[m0f], %[wb], %[wb]\n\t" \
        "vpsrlw $2, 128(%[q]), %[t1]\n\t" \
        "vpand %[m30], %[t1], %[t1]\n\t" \
        "vpor %[t1], %[wb], %[wb]\n\t" SUB(wb) \
        ROWS(M, 8)
#define OPERANDS \
        : [s0] "+x"(s0), [s1] "+x"(s1), [s2] "+x"(s2), [s3] "+x"(s3), [s4] "+x"(s4), \
          [s5] "+x"(s5), [s6] "+x"(s6), [s7] "+x"(s7), [wa] "=&x"(wa), [wb] "=&x"(wb), \
          [t1] "=&x"(t1), [t2] "=&x"(t2) \
        : [q] "r"(q), [xa] "r"(xa), [xb] "r"(xb), [k] "r"(k), [k3] "r"(3 * k), [sp] "x"(sp), \
          [m0f] "x"(m0f), [m30] "x"(m30), [m32] "x"(m32) \
        : "memory"
    if constexpr (Fold) {
      asm(BODY(MF, W32) OPERANDS);
    } else {
      asm(BODY(MU, NONE) OPERANDS);
    }
#undef OPERANDS
#undef BODY
#undef MU
#undef MF
#undef W32
#undef NONE
#undef ROWS
#undef ROW
  }
  sum[0] = s0; sum[1] = s1; sum[2] = s2; sum[3] = s3;
  sum[4] = s4; sum[5] = s5; sum[6] = s6; sum[7] = s7;
}
#endif

// Rows [0, R) x the C units; x rows from `r0`, output rows from `r0`.
//
// Per group (kPerGroup, kUnit; x has a scale per group): acc += d_a*D*s*dot - M*o*d_a*sum(q_a),
// four float operations per row and unit, on the pipes the dot products use. kSpan (x scaled
// per span of groups within a superblock): per group only S += s*dot in float (a conversion
// and a fused multiply-add, where VPMULLD would take two uops of the dot products' port), and
// once per span acc += d_a*(D*S - M*sum_g o*sum(q_a)), that sum by 16-bit dot products over
// pairs of groups. kSpanFold (w = D s (u - 32), a span a superblock): S sums s times the dots
// of (q_a + 128) and (u - 32), which is sum_g s sum(u q_a) - 32 sum_g s sum(q_a) + C with the
// weight's constant C = 128 sum_g s sum(u - 32): acc += d_a*D*(S - C), the same integer as
// kSpan's without its offsets' dot products.
template <int Bits, int G, int R, int C, int Mode>
void tile(const Layout& l, const Unit* u, const QuantX& x, int64_t r0, const Out& o) {
  constexpr bool kFold = Mode == kSpanFold;
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zerof();
  const int32_t* xq[R];
  for (int r = 0; r < R; ++r)
    xq[r] = kFold ? reinterpret_cast<const int32_t*>(&x.qu[(r0 + r) * x.k])
                  : reinterpret_cast<const int32_t*>(&x.q[(r0 + r) * x.k]);
  for (int64_t s0 = 0, sb = 0; s0 < l.groups; s0 += l.supers_every, ++sb) {
    VF dv[C], mv[C];
    for (int c = 0; c < C; ++c) {
      const at::Half* d = u[c].sup + sb * 2 * kLanes;
      dv[c] = V::half(d);
      mv[c] = V::half(d + kLanes);
    }
    const int64_t g1 = std::min(l.groups, s0 + l.supers_every);
    if constexpr (Mode == kSpan || kFold) {
      for (int64_t p0 = s0; p0 < g1; p0 += x.per) {  // the spans of this superblock
        const int64_t p1 = std::min(g1, p0 + x.per);
        VF sum[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) sum[r][c] = V::zerof();
        if constexpr (V::kPairs16 && Bits != 8) {
          // s * dot from group_dots() in int32, summed over the span in int32 (a span is at
          // most 256 k's: |sum| <= 256 * 128 * 63 * 127 < 2^31), then float once
          VI isum[R][C];
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) isum[r][c] = V::zero();
#if INFER_QUANT_BITS == 256
          if constexpr (Bits == 6 && G == 16 && R == 8 && C == 1) {
            VI s8[8];
            span_q6<kFold>(u[0], p0, p1, l.sc_group, xq, s8);
            for (int r = 0; r < R; ++r) isum[r][0] = s8[r];
          } else
#endif
          for (int64_t g = p0; g < p1; ++g) {
            VI sp[C];
            for (int c = 0; c < C; ++c) {
              const int8_t* sg = u[c].sc + g * l.sc_group;
              sp[c] = V::pairs(sg, sg);
            }
            VI dot[R][C];
            group_dots<Bits, G, R, C, kFold>(u, g, xq, dot, sp);
            for (int r = 0; r < R; ++r)
              for (int c = 0; c < C; ++c) isum[r][c] = V::add(isum[r][c], dot[r][c]);
          }
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) sum[r][c] = V::tof(isum[r][c]);
        } else {
          for (int64_t g = p0; g < p1; ++g) {
            VI dot[R][C];
            group_dots<Bits, G, R, C, kFold>(u, g, xq, dot);
            for (int c = 0; c < C; ++c) {
              const VF sv = V::tof(V::int8(u[c].sc + g * l.sc_group));
              for (int r = 0; r < R; ++r)
                sum[r][c] = V::fmadd(V::tof(dot[r][c]), sv, sum[r][c]);
            }
          }
        }
        if constexpr (kFold) {  // D (S - C)
          VF cv[C];
          for (int c = 0; c < C; ++c)
            cv[c] = V::tof(V::load(reinterpret_cast<const uint8_t*>(u[c].cc + sb * kLanes)));
          for (int r = 0; r < R; ++r) {
            const VF da = V::set1f(x.d[(r0 + r) * x.spans + p0 / x.per]);
            for (int c = 0; c < C; ++c)
              acc[r][c] = V::fmadd(V::mul(dv[c], V::subf(sum[r][c], cv[c])), da, acc[r][c]);
          }
        } else {
          // sum_g o * sum(q_a), two groups per 16-bit dot: each lane's (o_g, o_g+1) as a pair
          VI mins[R][C];
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) mins[r][c] = V::zero();
          for (int64_t g = p0; g < p1; g += 2) {
            VI pair[C];
            for (int c = 0; c < C; ++c) {
              const int8_t* og = u[c].sc + g * l.sc_group + l.o_at;
              pair[c] = V::pairs(og, og + l.sc_group);
            }
            for (int r = 0; r < R; ++r) {
              int32_t both;
              std::memcpy(&both, &x.bsum[(r0 + r) * x.groups + g], sizeof both);
              const VI bs = V::set1(both);
              for (int c = 0; c < C; ++c) mins[r][c] = V::dot16(mins[r][c], pair[c], bs);
            }
          }
          for (int r = 0; r < R; ++r) {
            const VF da = V::set1f(x.d[(r0 + r) * x.spans + p0 / x.per]);
            for (int c = 0; c < C; ++c) {
              // D (S - 32 sum_g s sum(q_a)) where M = 32 D: the AMX tiles' number (amx_scale)
              const VF t =
                  l.fold ? V::mul(dv[c], V::subf(sum[r][c], V::tof(V::slli32(mins[r][c], 5))))
                         : V::fnmadd(mv[c], V::tof(mins[r][c]), V::mul(dv[c], sum[r][c]));
              acc[r][c] = V::fmadd(t, da, acc[r][c]);
            }
          }
        }
      }
    } else {
      for (int64_t g = s0; g < g1; ++g) {
        VI dot[R][C];
        group_dots<Bits, G, R, C>(u, g, xq, dot);
        // the group's scales after its dot products: fewer registers live across them
        VF sv[C], ov[C];
        for (int c = 0; c < C; ++c) {
          if constexpr (Mode == kUnit) {  // s = o = 1: D and M are the group's
            sv[c] = dv[c];
            ov[c] = mv[c];
          } else {
            sv[c] = V::mul(dv[c], V::tof(V::int8(u[c].sc + g * l.sc_group)));
            ov[c] = V::mul(mv[c], V::tof(V::int8(u[c].sc + g * l.sc_group + l.o_at)));
          }
        }
        for (int r = 0; r < R; ++r) {
          const float d = x.d[(r0 + r) * x.spans + g];
          const VF da = V::set1f(d);
          const VF ds = V::set1f(d * static_cast<float>(x.bsum[(r0 + r) * x.groups + g]));
          for (int c = 0; c < C; ++c) {
            acc[r][c] = V::fmadd(V::mul(V::tof(dot[r][c]), da), sv[c], acc[r][c]);
            acc[r][c] = V::fnmadd(ov[c], ds, acc[r][c]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) put_row<C>(o, r0 + r, acc[r]);
}

template <int Bits, int G, int C, int Mode>
void rows_tile(int64_t rows, const Layout& l, const Unit* u, const QuantX& x, int64_t r0,
               const Out& o) {
  if constexpr (C == 1 && wide_tile(Bits))
    if (rows == kWideRows) return tile<Bits, G, kWideRows, C, Mode>(l, u, x, r0, o);
  switch (rows) {
    case 4: return tile<Bits, G, 4, C, Mode>(l, u, x, r0, o);
    case 3: return tile<Bits, G, 3, C, Mode>(l, u, x, r0, o);
    case 2: return tile<Bits, G, 2, C, Mode>(l, u, x, r0, o);
    default: return tile<Bits, G, 1, C, Mode>(l, u, x, r0, o);
  }
}

template <int Bits, int G, int C>
void mode_tile(int64_t rows, const Layout& l, const Unit* u, const QuantX& x, int64_t r0,
               const Out& o) {
  if constexpr (Bits == 6 && G == 16)  // where linear() made x + 128 (see there)
    if (!x.qu.empty()) return rows_tile<Bits, G, C, kSpanFold>(rows, l, u, x, r0, o);
  if (x.per > 1) return rows_tile<Bits, G, C, kSpan>(rows, l, u, x, r0, o);
  if (l.sc_group == 0) return rows_tile<Bits, G, C, kUnit>(rows, l, u, x, r0, o);
  return rows_tile<Bits, G, C, kPerGroup>(rows, l, u, x, r0, o);
}

template <int Bits, int G>
void run_tile(int64_t rows, const Layout& l, const Unit* u, int64_t units, const QuantX& x,
              int64_t r0, const Out& o) {
  if (units == 2) return mode_tile<Bits, G, 2>(rows, l, u, x, r0, o);
  return mode_tile<Bits, G, 1>(rows, l, u, x, r0, o);
}

void run_tile(int64_t rows, const Layout& l, const Unit* u, int64_t units, const QuantX& x,
              int64_t r0, const Out& o) {
  if (l.bits == 4) {
    if (l.group == 32) return run_tile<4, 32>(rows, l, u, units, x, r0, o);
    return run_tile<4, 16>(rows, l, u, units, x, r0, o);
  }
  if (l.bits == 6) {
    if (l.group == 32) return run_tile<6, 32>(rows, l, u, units, x, r0, o);
    return run_tile<6, 16>(rows, l, u, units, x, r0, o);
  }
  if (l.group == 32) return run_tile<8, 32>(rows, l, u, units, x, r0, o);
  return run_tile<8, 16>(rows, l, u, units, x, r0, o);
}

#ifdef INFER_QUANT_AMX
// AMX for the K-quants (Intel since Sapphire Rapids), 16 rows at a time. TDPBSUD/TDPBSSD
// multiply 16 rows of 64 int8 x's by 64 k's of 16 columns of bytes in the VNNI order the
// packed weights have, accumulating int32 in a tile. A group's scale s goes in before them:
// per span (256 k's, x's scale span) the unit's weights become v = u * s, held as two byte
// planes, lo = v & (2^b - 1) (unsigned) and hi = v >> b (signed), b = 6 for 4-bit weights
// (v <= 15 * 63) and 7 for 6-bit ones (|v| <= 63 * 128), so that
//   S = sum_g s * sum(u q_a) = 2^b * sum(hi q_a) + sum(lo q_a)
// is exact in int32 after the span's products of 64 k's, with no work per group. The rest is
// the kSpan tile's: acc += d_a * (D * S - M * sum_g o * sum(q_a)), so the outputs are the
// vector tile's whenever its float sum of s * dot over a span is exact (below 2^24 in
// magnitude, as a span's sums are unless nearly every x and u of it is at its largest).
// Where the layout folds Q6_K's offsets in (o = s, M = 32 D), v = s * (u - 32) instead and
// acc += d_a * D * S, with no offsets term: the vector tile's d_a * D * (S - 32 * sum_g s *
// sum(q_a)), the same while that last sum times 32 is below 2^24 too.
constexpr int64_t kAmxRows = 16;
// Rows a pass needs for AMX: below, scaling the weights costs more than the tiles save. One
// tile already pays for 6-bit weights, whose vector tiles unpack the most; 4-bit weights need
// two. A call of many rows goes in passes of more rows than the vector tiles', for the same
// reason.
constexpr int64_t amx_least(int64_t bits) { return bits == 4 ? 2 * kAmxRows : kAmxRows; }
constexpr int64_t kAmxRowBlock = 256;
// Where v = u * s splits into its planes: 4-bit weights v <= 15 * 63, 6-bit |v| <= 63 * 128
// (or |s (u - 32)| <= 128 * 32 where the layout folds Q6_K's offsets in).
constexpr int amx_shift(int bits) { return bits == 4 ? 6 : 7; }

// Q4_K (4 bits, G 32, s and o), Q5_K (6-bit layout, G 32, s and o) and Q6_K (G 16, o = s)
bool amx_fits(const Layout& l, const QuantX& x) {
  const bool k4 = l.bits == 4 && l.group == 32 && l.supers_every == 8 && l.o_at == kLanes;
  const bool k6 = l.bits == 6 && l.supers_every * l.group == 256 && l.sc_group > 0;
  return (k4 || k6) && x.per * l.group == kSpanK && l.k % kSpanK == 0;
}

// A unit's v = u * s for the groups of span `sp` as two byte planes (steps of 64 bytes, as the
// packed layout), written from the planes' start: a span's planes stay in L1 while every row
// tile of the pass takes its products from them.
template <int Bits, int G, bool Fold>
void amx_scale(const Layout& l, const Unit& u, int64_t sp, uint8_t* lo, uint8_t* hi) {
  constexpr int kShift = amx_shift(Bits);
  constexpr int64_t kGroupBytes = G * kLanes * Bits / 8;
  constexpr int64_t kGroups = kSpanK / G;
  const __m512i even = _mm512_set1_epi16(0x00FF);
  const __m512i low = _mm512_set1_epi16((1 << kShift) - 1);
  for (int64_t j = 0; j < kGroups; ++j) {
    const int64_t g = sp * kGroups + j;
    // s (its byte) of each of the 16 columns in the four bytes of its lane, in even or odd bytes
    const __m512i s = _mm512_mullo_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u.sc + g * l.sc_group))),
        _mm512_set1_epi32(0x01010101));
    const __m512i s_even = _mm512_and_si512(s, even), s_odd = _mm512_andnot_si512(even, s);
    // 32 s as int16 (s is the high byte of each 16-bit lane), taken off where w = D s (u - 32)
    const __m512i s32 = _mm512_slli_epi16(_mm512_srai_epi16(s, 8), 5);
    const uint8_t* q = u.q + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)  // as group_dots does
      _mm_prefetch(reinterpret_cast<const char*>(q) + line + kAhead, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int st = 0; st < G / 4; ++st) {
      // four steps a 192-byte quad for 6 bits; weights<4> takes the group's step itself
      const __m512i w = Bits == 4 ? weights<4>(q, st) : weights<6>(q + st / 4 * 192, st % 4);
      // v of the even bytes, and of the odd ones, as int16 (VPMADDUBSW with a zero partner)
      __m512i ve = _mm512_maddubs_epi16(w, s_even), vo = _mm512_maddubs_epi16(w, s_odd);
      if constexpr (Fold) {
        ve = _mm512_sub_epi16(ve, s32);
        vo = _mm512_sub_epi16(vo, s32);
      }
      const __m512i l8 = _mm512_or_si512(_mm512_and_si512(ve, low),
                                         _mm512_slli_epi16(_mm512_and_si512(vo, low), 8));
      const __m512i h8 = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(ve, kShift), even),
                                         _mm512_slli_epi16(_mm512_srai_epi16(vo, kShift), 8));
      const int64_t step = j * (G / 4) + st;
      V::storei(lo + step * 64, l8);
      V::storei(hi + step * 64, h8);
    }
  }
}

// x's rows quantized, in the order amx_span reads them: per span, per 16-row tile, its 64-k
// chunks of 16 rows x 64 bytes, each one contiguous tile load.
void amx_layout(const QuantX& x, int64_t rows, int64_t span_k, std::vector<int8_t>& out) {
  const int64_t tiles = rows / kAmxRows, spans = x.k / span_k, chunks = span_k / 64;
  out.resize(tiles * kAmxRows * x.k);
  at::parallel_for(0, tiles * spans, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t sp = i / tiles, t = i % tiles;
      int8_t* dst = &out[i * chunks * kAmxRows * 64];
      for (int64_t ch = 0; ch < chunks; ++ch)
        for (int64_t r = 0; r < kAmxRows; ++r)
          std::memcpy(dst + (ch * kAmxRows + r) * 64,
                      &x.q[(t * kAmxRows + r) * x.k + sp * span_k + ch * 64], 64);
    }
  });
}

// One span of rows [16 t, 16 t + 16) x the C units, from their span's planes lo[c], hi[c] (see
// amx_scale), added to acc [16][C][16].
template <int Bits, int G, int C>
void amx_span(const Layout& l, const Unit* u, uint8_t* const* lo, uint8_t* const* hi,
              const QuantX& x, const int8_t* xt, int64_t t, int64_t sp, float* acc) {
  constexpr int kShift = amx_shift(Bits);
  alignas(64) int32_t sums[2 * C][kAmxRows][kLanes];
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (C == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t ch = 0; ch < kSpanK / 64; ++ch) {
    const int64_t at = ch * 64 * kLanes;  // byte in a plane
    // the x tiles that follow in the layout (the next tile's, or the next span's), 1 KB a chunk:
    // they come from L2 and would stall the next span's first product
    for (int64_t line = 0; line < kAmxRows * 64; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(xt + kSpanK * kAmxRows + ch * kAmxRows * 64 + line),
                   _MM_HINT_T0);
    _tile_loadd(4, xt + ch * kAmxRows * 64, 64);
    _tile_loadd(5, lo[0] + at, 64);
    _tile_loadd(6, hi[0] + at, 64);
    _tile_dpbsud(0, 4, 5);
    _tile_dpbssd(1, 4, 6);
    if constexpr (C == 2) {
      _tile_loadd(7, lo[1] + at, 64);
      _tile_loadd(5, hi[1] + at, 64);
      _tile_dpbsud(2, 4, 7);
      _tile_dpbssd(3, 4, 5);
    }
  }
  _tile_stored(0, sums[0], sizeof sums[0][0]);
  _tile_stored(1, sums[1], sizeof sums[0][0]);
  if constexpr (C == 2) {
    _tile_stored(2, sums[2], sizeof sums[0][0]);
    _tile_stored(3, sums[3], sizeof sums[0][0]);
  }
  constexpr int64_t kGroups = kSpanK / G;
  const int64_t g0 = sp * kGroups, sb = g0 / l.supers_every;
  VF dv[C], mv[C];
  for (int c = 0; c < C; ++c) {
    const at::Half* d = u[c].sup + sb * 2 * kLanes;
    dv[c] = V::half(d);
    mv[c] = V::half(d + kLanes);
  }
  // S of unit c, row r: exact in int32
  auto span_sum = [&](int c, int r) {
    const VI lo_s = V::load(reinterpret_cast<const uint8_t*>(sums[2 * c][r]));
    const VI hi_s = V::load(reinterpret_cast<const uint8_t*>(sums[2 * c + 1][r]));
    return V::tof(_mm512_add_epi32(_mm512_slli_epi32(hi_s, kShift), lo_s));
  };
  if (l.fold) {  // w = D s (u - 32): the planes took the offsets in (amx_scale), acc += d_a D S
    for (int r = 0; r < kAmxRows; ++r) {
      const VF da = V::set1f(x.d[(t * kAmxRows + r) * x.spans + sp]);
      for (int c = 0; c < C; ++c) {
        float* a = acc + (r * C + c) * kLanes;
        V::store(a, V::fmadd(V::mul(dv[c], span_sum(c, r)), da, V::loadf(a)));
      }
    }
    return;
  }
  VI pair[C][kGroups / 2];
  for (int c = 0; c < C; ++c) {
    for (int p = 0; p < kGroups / 2; ++p) {
      const int8_t* og = u[c].sc + (g0 + 2 * p) * l.sc_group + l.o_at;
      pair[c][p] = V::pairs(og, og + l.sc_group);
    }
  }
  for (int r = 0; r < kAmxRows; ++r) {
    const int64_t row = t * kAmxRows + r;
    const VF da = V::set1f(x.d[row * x.spans + sp]);
    VI both[kGroups / 2];
    for (int p = 0; p < kGroups / 2; ++p) {
      int32_t b;
      std::memcpy(&b, &x.bsum[row * x.groups + g0 + 2 * p], sizeof b);
      both[p] = V::set1(b);
    }
    for (int c = 0; c < C; ++c) {
      VI mins = V::zero();
      for (int p = 0; p < kGroups / 2; ++p) mins = V::dot16(mins, pair[c][p], both[p]);
      const VF tv = V::fnmadd(mv[c], V::tof(mins), V::mul(dv[c], span_sum(c, r)));
      float* a = acc + (r * C + c) * kLanes;
      V::store(a, V::fmadd(tv, da, V::loadf(a)));
    }
  }
}

// Rows [r, r1) in full 16-row tiles x the C units, span by span: each span's planes are scaled
// once and serve every tile of the pass.
template <int Bits, int G, int C>
void amx_run(const Layout& l, const Unit* u, const QuantX& x, const int8_t* xl, int64_t& r,
             int64_t r1, const Out& o, uint8_t* planes, std::vector<float>& acc) {
  constexpr int64_t kPlane = kSpanK * kLanes;  // bytes of one unit's plane for one span
  constexpr int64_t kTileAcc = kAmxRows * C * kLanes;
  const int64_t t0 = r / kAmxRows, tiles = (r1 - r) / kAmxRows, all = x.q.size() / x.k / kAmxRows;
  uint8_t *lo[2], *hi[2];
  for (int c = 0; c < C; ++c) {
    lo[c] = planes + 2 * c * kPlane;
    hi[c] = lo[c] + kPlane;
  }
  acc.assign(tiles * kTileAcc, 0.0f);
  for (int64_t sp = 0; sp < l.k / kSpanK; ++sp) {
    for (int c = 0; c < C; ++c) {
      if (Bits == 6 && l.fold) {
        amx_scale<Bits, G, true>(l, u[c], sp, lo[c], hi[c]);
      } else {
        amx_scale<Bits, G, false>(l, u[c], sp, lo[c], hi[c]);
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int8_t* xt = xl + (sp * all + t0 + t) * kSpanK * kAmxRows;
      amx_span<Bits, G, C>(l, u, lo, hi, x, xt, t0 + t, sp, acc.data() + t * kTileAcc);
    }
  }
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < kAmxRows; ++i) {
      VF a[C];
      for (int c = 0; c < C; ++c) a[c] = V::loadf(&acc[t * kTileAcc + (i * C + c) * kLanes]);
      put_row<C>(o, r + t * kAmxRows + i, a);
    }
  r += tiles * kAmxRows;
}

template <int Bits, int G>
void amx_run(const Layout& l, const Unit* u, int64_t units, const QuantX& x, const int8_t* xl,
             int64_t& r, int64_t r1, const Out& o, uint8_t* planes, std::vector<float>& acc) {
  if (units == 2) return amx_run<Bits, G, 2>(l, u, x, xl, r, r1, o, planes, acc);
  amx_run<Bits, G, 1>(l, u, x, xl, r, r1, o, planes, acc);
}

// The full 16-row tiles of rows [r, r1) on AMX (x also in amx_layout's order, xl); returns the
// first row it left.
int64_t amx_tiles(const Layout& l, const Unit* u, int64_t units, const QuantX& x,
                  const int8_t* xl, int64_t r, int64_t r1, const Out& o) {
  if (r1 - r < amx_least(l.bits)) return r;
  // two units' lo and hi planes for one span: 16 KB
  alignas(64) uint8_t planes[2 * 2 * kSpanK * kLanes];
  thread_local std::vector<float> acc;  // the pass's float sums, [tiles][16][units][16]
  configure_tiles({{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}});
  if (l.bits == 4) {
    amx_run<4, 32>(l, u, units, x, xl, r, r1, o, planes, acc);
  } else if (l.group == 32) {
    amx_run<6, 32>(l, u, units, x, xl, r, r1, o, planes, acc);
  } else {
    amx_run<6, 16>(l, u, units, x, xl, r, r1, o, planes, acc);
  }
  _tile_release();
  return r;
}
#endif

// Frees v's storage where it is over 4 MB (a decode step of 256 rows x 8960 k's takes 2.3).
template <typename T>
void keep_small(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > (size_t{4} << 20)) std::vector<T>().swap(v);
}

// An output of `width` columns for x's rows: float32 where asked or where x is float32 (a
// float32 model), else bf16.
at::Tensor empty_out(const at::Tensor& x, int64_t width, bool out_float) {
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  return at::empty(sizes, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
}

// x @ W.T (+ bias, then the activation of a gated weight). `into`, where given, is the output
// of a weight of several parts: this part's columns go to its columns from col0 on.
at::Tensor linear_part(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool out_float, Act act,
                       at::Tensor* into, int64_t col0) {
  const Layout l = layout_of(weight);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or float32");
  TORCH_CHECK(x.size(-1) == l.k, "x's last axis does not match the weight");
  TORCH_CHECK(act == kNone || l.n % (kCols * kLanes) == 0,
              "a gated weight needs a multiple of 32 output features");
  auto x2 = x.reshape({-1, l.k}).contiguous();
  const int64_t rows = x2.size(0);
  // x scaled per span of an even number of groups that divides the weight's superblocks
  // (the K-quants: 256 k's, 8 groups of Q4_K and 16 of Q6_K), else per group
  int64_t per = 1;
  if (l.supers_every % 2 == 0 && l.groups % l.supers_every == 0 && l.sc_group > 0)
    for (int64_t p = 2; p <= std::min(l.supers_every, kSpanK / l.group); p += 2)
      if (l.supers_every % p == 0) per = p;
  // x quantized (and below, its AMX copy) in buffers the calling thread keeps between calls,
  // so that the calls of a decode step reuse pages instead of faulting in fresh zeroed ones.
  // (References: the work items run on other threads, which must see these.)
  thread_local QuantX kept_qx;
  thread_local std::vector<int8_t> kept_xl;
  QuantX& qx = kept_qx;
  std::vector<int8_t>& xl = kept_xl;
  // A call of several rows over weights D s (u - 32) also takes x + 128, unsigned
  // (kSpanFold): no offsets' dot products per row and span. One row keeps them: its call is
  // bound by reading the weights, where C would be 2% more bytes and u - 32 one more
  // instruction a weight vector. Both compute the same integers, so their outputs agree while
  // the span sums stay under 2^24, as the targets' do.
  const bool fold_tiles = l.fold && l.cc && rows > 1 && per == l.supers_every && l.bits == 6 &&
                          l.group == 16;
  if (x2.scalar_type() == at::kFloat) {
    quantize_rows(x2.data_ptr<float>(), rows, l.k, l.group, per, fold_tiles, qx);
  } else {
    quantize_rows(x2.data_ptr<c10::BFloat16>(), rows, l.k, l.group, per, fold_tiles, qx);
  }
  const int64_t width = act == kNone ? l.n : l.n / 2;
  // float32 activations get float32 outputs (a float32 model); bf16 ones bf16 unless asked.
  out_float = out_float || x.scalar_type() == at::kFloat;
  at::Tensor out = into ? *into : empty_out(x, width, out_float);
  const int64_t ldo = into ? into->size(-1) : width;  // elements per output row
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == l.n, "bias must be [out_features]");
  }
  const int64_t blocks = l.n / kLanes;
  // A few rows are bound by reading the weights, and CPUs differ in which order reads
  // fastest (figures in bench/results/LOG.md). On Intel (Emerald Rapids) one row's pass
  // pairs a block of the first half with its twin in the second half, two streams far
  // apart. On AMD (Zen 5) up to 4 rows read one stream per thread, block after block, a
  // block a pass; a gated call there takes a gate block whole, then its up block (the next
  // in memory), each into float sums, then the activation. Each column's numbers are the
  // same whichever unit shares its pass. On 8 lanes a unit is half a block, half of each
  // line: there a pass takes both halves of one block (twins far apart would read every
  // line twice).
  static const bool far_twins = __builtin_cpu_is("intel");
  const bool far = rows == 1 && far_twins && act == kNone && blocks % 2 == 0 && kW == kLanes;
  const bool one_stream = rows <= kRows && !far_twins;
  const int64_t items = far ? blocks / 2 : (blocks + kCols - 1) / kCols;
#ifdef INFER_QUANT_AMX
  const bool amx = use_amx() && amx_fits(l, qx) && rows >= amx_least(l.bits);
  const int64_t row_block = amx ? kAmxRowBlock : kRowBlock;
  if (amx) amx_layout(qx, rows, kSpanK, xl);
#else
  const int64_t row_block = kRowBlock;
#endif
  const int64_t row_blocks = (rows + row_block - 1) / row_block;
  constexpr int64_t kHalves = kLanes / kW;  // units per block
  const int64_t elem = out_float ? 4 : 2;
  char* const out_at = static_cast<char*>(out.data_ptr()) + col0 * elem;
  // The unit of block `blk` that starts `half` vectors in.
  auto unit = [&](int64_t blk, int64_t half) {
    return Unit{l.q + blk * l.q_block + half * kW * 4, l.sc + blk * l.sc_block + half * kW,
                l.sup + blk * l.sup_block + half * kW,
                l.cc ? l.cc + blk * l.cc_block + half * kW : nullptr, one_stream};
  };
  // units a pass, not gated: one where a tile of one unit is wide or one row reads a stream
  // (on 8 lanes a pass of two reads one block)
  const int64_t per_pass =
      (wide_tile(l.bits) && rows >= kWideRows) || (one_stream && kHalves == 1) ? 1 : 2;
  auto work = [&](int64_t i, int64_t) {
    const int64_t t = i % items, rb = i / items;
    const int64_t b0 = t * kCols, nblocks = std::min(kCols, blocks - b0);
    const int64_t r1 = std::min(rows, (rb + 1) * row_block);
    if (one_stream && act != kNone) {  // the gate block, then the up block (above)
      alignas(64) float sums[kRows][2 * kLanes];
      for (int64_t j = 0; j < 2; ++j) {
        Unit u[kHalves];
        for (int64_t h = 0; h < kHalves; ++h) u[h] = unit(b0 + j, h);
        const Out o{sums[0] + j * kLanes, 2 * kLanes, true,
                    b.defined() ? b.data_ptr<float>() + (b0 + j) * kLanes : nullptr, kNone};
        run_tile(rows, l, u, kHalves, qx, 0, o);
      }
      for (int64_t h = 0; h < kHalves; ++h) {
        const int64_t col = b0 / 2 * kLanes + h * kW;
        const Out o{out_at + col * elem, ldo, out_float, nullptr, act};
        for (int64_t r = 0; r < rows; ++r) {
          const VF acc[2] = {V::loadf(sums[r] + h * kW), V::loadf(sums[r] + kLanes + h * kW)};
          put_row<2>(o, r, acc);
        }
      }
      return;
    }
    // Passes of up to two units: a gated item pairs each gate unit with its up unit (the
    // next block's, at the same offset); one row on Intel pairs twins far apart (above);
    // else each pass takes consecutive units.
    const int64_t units = nblocks * kHalves;
    const int64_t passes =
        far ? 1 : act == kNone ? (units + per_pass - 1) / per_pass : kHalves;
    for (int64_t pass = 0; pass < passes; ++pass) {
      Unit u[2];
      int64_t n = 0, col = 0;
      int64_t unit_step = kW;
      if (far) {  // a unit is a whole block here (kW == kLanes)
        u[n++] = unit(t, 0);
        u[n++] = unit(t + blocks / 2, 0);
        col = t * kLanes;
        unit_step = blocks / 2 * kLanes;
      } else if (act == kNone) {
        for (int64_t j = per_pass * pass; j < std::min(units, per_pass * pass + per_pass); ++j)
          u[n++] = unit(b0 + j / kHalves, j % kHalves);
        col = b0 * kLanes + per_pass * pass * kW;
      } else {
        u[n++] = unit(b0, pass);
        u[n++] = unit(b0 + 1, pass);
        col = b0 / 2 * kLanes + pass * kW;
      }
      const int64_t in_col = act == kNone ? col : b0 * kLanes + pass * kW;
      Out o{out_at + col * elem, ldo, out_float,
            b.defined() ? b.data_ptr<float>() + in_col : nullptr, act, unit_step};
      int64_t r = rb * row_block;
#ifdef INFER_QUANT_AMX
      if (amx) r = amx_tiles(l, u, n, qx, xl.data(), r, r1, o);
#endif
      while (r < r1) {
        if (act != kNone && wide_tile(l.bits) && r1 - r >= kWideRows) {
          // a gated pass in tiles of one unit: the gate's sums, the up's, then the activation
          alignas(64) float sums[kWideRows][2 * kW];
          for (int64_t j = 0; j < 2; ++j) {
            Out so{sums[0] + j * kW, 2 * kW, true, nullptr, kNone};
            so.first_row = r;
            run_tile(kWideRows, l, &u[j], 1, qx, r, so);
          }
          for (int64_t i = 0; i < kWideRows; ++i) {
            const VF acc[2] = {V::loadf(sums[i]), V::loadf(sums[i] + kW)};
            put_row<2>(o, r + i, acc);
          }
          r += kWideRows;
          continue;
        }
        const int64_t t = n == 1 && wide_tile(l.bits) && r1 - r >= kWideRows
                              ? kWideRows
                              : std::min(kRows, r1 - r);
        run_tile(t, l, u, n, qx, r, o);
        r += t;
      }
    }
  };
  parallel_owned(items * row_blocks, work);
  // a prefill chunk's buffers go back: only a decode step's sizes stay
  keep_small(qx.q);
  keep_small(qx.qu);
  keep_small(xl);
  return out;
}

// A weight packed as several parts (quant.pack_parts: q and k beside a v of more bits, each
// read at its own bits): a header of kPartsMagic, the count and each part's offset, then
// the parts, each a weight of its own. Empty for any other weight.
std::vector<at::Tensor> parts_of(const at::Tensor& w) {
  std::vector<at::Tensor> parts;
  if (w.scalar_type() != at::kByte || w.dim() != 1 || !w.is_contiguous() || w.numel() < kHeader)
    return parts;
  int64_t h[kHeader / 8];
  std::memcpy(h, w.data_ptr<uint8_t>(), sizeof h);
  if (h[0] != kPartsMagic) return parts;
  const int64_t count = h[1];
  TORCH_CHECK(count >= 1 && count <= kHeader / 8 - 2, "a weight of parts has 1 to ",
              kHeader / 8 - 2, " parts");
  for (int64_t i = 0; i < count; ++i) {
    const int64_t from = h[2 + i], to = i + 1 < count ? h[3 + i] : w.numel();
    TORCH_CHECK(from >= kHeader && from < to && to <= w.numel(),
                "a weight of parts is truncated");
    parts.push_back(w.narrow(0, from, to - from));
  }
  return parts;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, bool out_float, Act act) {
  const std::vector<at::Tensor> parts = parts_of(weight);
  if (parts.empty()) return linear_part(x, weight, bias, out_float, act, nullptr, 0);
  TORCH_CHECK(act == kNone, "a gated weight has one part");
  std::vector<int64_t> widths;
  int64_t n = 0;
  for (const auto& p : parts) n += widths.emplace_back(layout_of(p).n);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "bias must be [out_features]");
  out_float = out_float || x.scalar_type() == at::kFloat;
  at::Tensor out = empty_out(x, n, out_float);
  at::Tensor rows = out.view({-1, n});
  int64_t col = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    c10::optional<at::Tensor> part_bias;
    if (has_bias) part_bias = bias->reshape({-1}).narrow(0, col, widths[i]);
    linear_part(x, parts[i], part_bias, out_float, kNone, &rows, col);
    col += widths[i];
  }
  return out;
}

}  // namespace

bool has_quant_linear() { return true; }

std::string quant_isa() {
#if INFER_QUANT_BITS == 512
  return "avx512vnni";
#elif defined(__AVXVNNI__)
  return "avxvnni";
#else
  return "avx2";
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool out_float) {
  return linear(x, weight, bias, out_float, kNone);
}

at::Tensor quant_gated_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, bool gelu) {
  return linear(x, weight, bias, false, gelu ? kGelu : kSilu);
}

#else  // below AVX2: quantized weights are dequantized at load instead

bool has_quant_linear() { return false; }

std::string quant_isa() { return ""; }

at::Tensor quant_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                        bool) {
  TORCH_CHECK(false, "this CPU has no AVX2");
}

at::Tensor quant_gated_linear(const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "this CPU has no AVX2");
}

#endif
