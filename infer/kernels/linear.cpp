// bf16 linear layers for the row counts of decode (1 to a few hundred rows), with AVX512-BF16.
//
// The weight [N, K] is packed once into [N/16, K/2, 16, 2]: one 64-byte load holds two k's
// of 16 output columns, which is what VDPBF16PS multiplies against a broadcast pair of x
// values, accumulating in float. A tile of kRows rows x kCols*16 columns keeps its
// accumulators in registers across all of K, so each weight load feeds kRows FMAs; each
// thread runs its own share of column groups in order, prefetching the next group's weights,
// and rows go 64 at a time so that a row block stays in L2 while the weights stream past it.
// Each output element is one dot product accumulated in k order, whatever the number of
// rows: results do not depend on the batch.
//
// bf16_gated_linear is the MLP's gate/up projection with its activation: the weight's rows
// come 32 gate then 32 up at a time, so a tile's float accumulators hold matching gate and
// up columns and it writes only act(gate) * up, instead of the projection plus a separate
// activation pass.
//
// oneDNN reorders weights the same way, but its per-call cost at these sizes left one row's
// linears at half the memory bandwidth.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kLanes = 16;      // output columns per packed block
constexpr int64_t kCols = 4;        // packed blocks per tile (64 columns)
constexpr int64_t kRows = 6;        // rows per tile: 24 accumulators + 4 weights + 1 broadcast
constexpr int64_t kRowBlock = 64;   // rows per pass over the weights

// The gated projection's activations: none (a plain linear), SiLU or tanh-GELU; or erf-GELU
// on a plain linear's outputs (BERT's intermediate projection).
enum Act : int { kNone = 0, kSilu = 1, kGelu = 2, kGeluErf = 3 };

inline bool gated(Act act) { return act == kSilu || act == kGelu; }

// What the tiles of one work item share: its 64-column group of the packed weight, and where
// the weights of the thread's next item are, to prefetch a line of every `pf_every` k pairs.
// With an activation, the group's first 32 columns are gate and its last 32 up, and the tile
// writes act(gate) * up: 32 columns.
struct Group {
  const c10::BFloat16* w;
  int64_t block_stride, k_pairs;
  const float* bias;
  int64_t cols_left, ldo;
  bool out_float;
  int64_t pf_every;
  Act act;
};

// The epilogue of one output row: bias, the gated activation (act(gate) * up), erf-GELU or
// none, then bf16 or float stores of the row's C blocks of 16 columns. Both kernels end with it, so their
// results round alike.
template <int C>
inline void finish_row(const Group& g, const __m512* acc, void* out) {
  if constexpr (C == kCols) {
    if (gated(g.act)) {
      for (int c = 0; c < C / 2; ++c) {
        const __m512 bg = g.bias ? _mm512_loadu_ps(g.bias + c * kLanes) : _mm512_setzero_ps();
        const __m512 bu =
            g.bias ? _mm512_loadu_ps(g.bias + (c + C / 2) * kLanes) : _mm512_setzero_ps();
        const __m512 x = _mm512_add_ps(acc[c], bg);
        const __m512 y = _mm512_mul_ps(g.act == kSilu ? silu16(x) : gelu_tanh16(x),
                                       _mm512_add_ps(acc[c + C / 2], bu));
        auto* dst = static_cast<c10::BFloat16*>(out) + c * kLanes;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(y));
      }
      return;
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t n = std::min<int64_t>(kLanes, g.cols_left - c * kLanes);
    if (n <= 0) break;
    const __mmask16 mask = lanes(n);
    const __m512 b =
        g.bias ? _mm512_maskz_loadu_ps(mask, g.bias + c * kLanes) : _mm512_setzero_ps();
    __m512 v = _mm512_add_ps(acc[c], b);
    if (g.act == kGeluErf) v = gelu_erf16(v);
    if (g.out_float) {
      _mm512_mask_storeu_ps(static_cast<float*>(out) + c * kLanes, mask, v);
    } else {
      auto* dst = static_cast<c10::BFloat16*>(out) + c * kLanes;
      _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// One tile: rows [0, R) of x against column blocks [0, C) of the group; pf: the next
// weights' lines this tile prefetches (nullptr: none).
template <int R, int C>
inline void tile(const Group& g, const c10::BFloat16* x, int64_t ldx, void* out, const char* pf) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  for (int64_t kp = 0, p = 0; kp < g.k_pairs; ++kp) {
    if (pf && ++p == g.pf_every) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
      p = 0;
    }
    __m512bh wv[C];
    for (int c = 0; c < C; ++c)
      wv[c] = (__m512bh)_mm512_loadu_si512(g.w + c * g.block_stride + kp * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][kp]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    finish_row<C>(g, acc[r], static_cast<char*>(out) + r * g.ldo * (g.out_float ? 4 : 2));
}

template <int C>
inline void rows_tile(int64_t rows, const Group& g, const c10::BFloat16* x, int64_t ldx,
                      void* out, const char* pf) {
  switch (rows) {
    case 6: return tile<6, C>(g, x, ldx, out, pf);
    case 5: return tile<5, C>(g, x, ldx, out, pf);
    case 4: return tile<4, C>(g, x, ldx, out, pf);
    case 3: return tile<3, C>(g, x, ldx, out, pf);
    case 2: return tile<2, C>(g, x, ldx, out, pf);
    default: return tile<1, C>(g, x, ldx, out, pf);
  }
}

#ifdef INFER_AMX
// AMX (Intel since Sapphire Rapids): TDPBF16PS multiplies a tile of up to 16 rows x 32 k of x
// by a tile of 16 k pairs x 16 columns of the packed weight, which is already in the tile's
// layout (a column block's k pairs are consecutive 64-byte rows), accumulating in a 16 x 16
// float tile. An item (up to kAmxRowBlock rows x 64 columns) runs 32 rows at a time in 2 x 2
// tiles (amx_tile32) and a tail of up to 16 rows in 1 x 4 (amx_tile: four accumulators across
// all of K, x once per 32 k, the weights in two alternating tiles). Each output element is
// still one dot product accumulated in k order whatever the number of rows, and the same
// epilogue rounds it.
constexpr int64_t kTileRows = 16;
// Rows per item: the weights stream past up to 512 rows of x, which stay in L2. Long rows
// (the MLP's down projection, K = 1536) go 256 at a time, keeping an item's x under 1 MB:
// 512 rows of 3 KB and the weights streaming past them overflowed the 2 MB L2.
constexpr int64_t kAmxRowBlock = 512;
constexpr int64_t amx_row_block(int64_t k) { return k > 768 ? kAmxRowBlock / 2 : kAmxRowBlock; }
// Tiles for m rows (1 to 16): accumulators (tmm0-3) and x (tmm4) are m rows of 64 bytes,
// the weights (tmm5, tmm6) 16 k pairs.
inline void configure_linear_tiles(int m) {
  configure_tiles({{m, 64}, {m, 64}, {m, 64}, {m, 64}, {m, 64}, {16, 64}, {16, 64}});
}

// The next item's weights, prefetched into L2 a few lines per k step while this item computes.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
};

// Rows [0, m) of x (m as configured) against column blocks [0, C) of the group.
template <int C>
inline void amx_tile(const Group& g, int m, const c10::BFloat16* x, int64_t ldx, char* out,
                     int64_t out_row_bytes, Prefetch& pf) {
  alignas(64) float acc[kTileRows][kCols * kLanes];
  constexpr int64_t kRowBytes = sizeof(acc[0]);
  _tile_zero(0);
  if constexpr (C > 1) _tile_zero(1);
  if constexpr (C > 2) _tile_zero(2);
  if constexpr (C > 3) _tile_zero(3);
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t kp = 0; kp < g.k_pairs; kp += 16) {
    const c10::BFloat16* w = g.w + kp * 2 * kLanes;
    for (int64_t i = 0; i < pf.per_step && pf.next < pf.end; ++i, pf.next += 64)
      _mm_prefetch(pf.next, _MM_HINT_T1);
    _tile_loadd(4, x + 2 * kp, x_stride);
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (C > 1) {
      _tile_loadd(6, w + g.block_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (C > 2) {
      _tile_loadd(5, w + 2 * g.block_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (C > 3) {
      _tile_loadd(6, w + 3 * g.block_stride, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, &acc[0][0], kRowBytes);
  if constexpr (C > 1) _tile_stored(1, &acc[0][kLanes], kRowBytes);
  if constexpr (C > 2) _tile_stored(2, &acc[0][2 * kLanes], kRowBytes);
  if constexpr (C > 3) _tile_stored(3, &acc[0][3 * kLanes], kRowBytes);
  for (int r = 0; r < m; ++r) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_load_ps(&acc[r][c * kLanes]);
    finish_row<C>(g, v, out + r * out_row_bytes);
  }
}

// 32 rows against column blocks [0, C) of the group, a pair of blocks at a time in 2 x 2
// tiles (x rows 0-15 and 16-31 in tmm4, tmm5; two blocks' weights in tmm6, tmm7): each
// weight tile loaded feeds two products, which halves the weights' traffic from L2 against
// amx_tile. Configured by configure_pair_tiles.
//
// The tile unit stalls on loads that miss L1, so both operands should come from it: the x
// rows are loaded normally and kept, for the second pair of blocks, while the weights, read
// once per 32 rows, are streamed (TILELOADDT1) past L1 instead of evicting them. K runs in
// chunks of at most kAmxKChunk, so 32 rows of a chunk fit L1; between chunks the
// accumulators wait in memory (exact: the sums still run in k order; the speed-up is in
// bench/results/LOG.md).
constexpr int64_t kAmxKChunk = 576;

// 2 x 2 blocks' accumulators, two buffers: while the tile unit computes one block, the
// previous block's rows go through the epilogue (bias, activation, bf16), a row per k step,
// so the vector units' work overlaps the tile products instead of following them (the gated
// projection's SiLU gains most).
using Acc32 = float[2 * kTileRows][kCols * kLanes];
template <int C>
struct PendingRows {
  const Group* g;
  const Acc32* acc = nullptr;
  char* out = nullptr;
  int64_t out_row_bytes = 0;
  int next = 0;

  void row() {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_load_ps(&(*acc)[next][c * kLanes]);
    finish_row<C>(*g, v, out + next * out_row_bytes);
    ++next;
  }
  void step() {
    if (next < 2 * kTileRows) row();
  }
  void finish() {
    while (next < 2 * kTileRows) row();
  }
};

// 32 rows into acc, while `pending` writes out the previous block's.
template <int C>
inline void amx_tile32(const Group& g, const c10::BFloat16* x, int64_t ldx, Acc32& acc,
                       PendingRows<C>& pending, Prefetch& pf) {
  constexpr int64_t kRowBytes = sizeof(acc[0]);
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(c10::BFloat16));
  const c10::BFloat16* x1 = x + kTileRows * ldx;
  const int64_t chunks = (2 * g.k_pairs + kAmxKChunk - 1) / kAmxKChunk;
  const int64_t chunk_pairs = (g.k_pairs / chunks + 15) / 16 * 16;
  for (int64_t k0 = 0; k0 < g.k_pairs; k0 += chunk_pairs) {
    const int64_t k1 = std::min(g.k_pairs, k0 + chunk_pairs);
    for (int c = 0; c < C; c += 2) {
      const bool two = c + 1 < C;
      if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(2);
        if (two) {
          _tile_zero(1);
          _tile_zero(3);
        }
      } else {
        _tile_loadd(0, &acc[0][c * kLanes], kRowBytes);
        _tile_loadd(2, &acc[kTileRows][c * kLanes], kRowBytes);
        if (two) {
          _tile_loadd(1, &acc[0][(c + 1) * kLanes], kRowBytes);
          _tile_loadd(3, &acc[kTileRows][(c + 1) * kLanes], kRowBytes);
        }
      }
      for (int64_t kp = k0; kp < k1; kp += 16) {
        const c10::BFloat16* w = g.w + c * g.block_stride + kp * 2 * kLanes;
        for (int64_t i = 0; i < pf.per_step && pf.next < pf.end; ++i, pf.next += 64)
          _mm_prefetch(pf.next, _MM_HINT_T1);
        _tile_loadd(4, x + 2 * kp, x_stride);
        _tile_stream_loadd(6, w, 64);
        _tile_loadd(5, x1 + 2 * kp, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
          _tile_stream_loadd(7, w + g.block_stride, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        pending.step();
      }
      _tile_stored(0, &acc[0][c * kLanes], kRowBytes);
      _tile_stored(2, &acc[kTileRows][c * kLanes], kRowBytes);
      if (two) {
        _tile_stored(1, &acc[0][(c + 1) * kLanes], kRowBytes);
        _tile_stored(3, &acc[kTileRows][(c + 1) * kLanes], kRowBytes);
      }
    }
  }
  pending.finish();
}

inline void configure_pair_tiles() {
  configure_tiles({{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64},
                   {16, 64}});
}

// Rows [r0, r1) of x against one group of C blocks, 32 rows at a time while they last, then
// 16 at a time, prefetching the bytes [pf, pf_end) of the next item's weights on the way.
template <int C>
inline void amx_item(const Group& g, const c10::BFloat16* x, int64_t ldx, int64_t r0,
                     int64_t r1, char* out, int64_t out_row_bytes, const char* pf,
                     const char* pf_end) {
  const int64_t steps = (r1 - r0 + kTileRows - 1) / kTileRows * (g.k_pairs / 16);
  Prefetch cursor{pf, pf_end, pf ? ((pf_end - pf) / 64 + steps - 1) / steps : 0};
  alignas(64) Acc32 acc[2];
  PendingRows<C> pending{&g, nullptr, nullptr, out_row_bytes, 2 * kTileRows};  // none yet
  int configured = 0;  // rows of the 1 x 4 configuration, or 32 for the 2 x 2 one
  int64_t r = r0;
  for (int i = 0; r1 - r >= 2 * kTileRows; r += 2 * kTileRows, i ^= 1) {
    if (configured != 2 * kTileRows) configure_pair_tiles();
    configured = 2 * kTileRows;
    amx_tile32<C>(g, x + r * ldx, ldx, acc[i], pending, cursor);
    pending = PendingRows<C>{&g, &acc[i], out + r * out_row_bytes, out_row_bytes, 0};
  }
  pending.finish();
  while (r < r1) {
    const int m = static_cast<int>(std::min(kTileRows, r1 - r));
    if (m != configured) configure_linear_tiles(configured = m);
    amx_tile<C>(g, m, x + r * ldx, ldx, out + r * out_row_bytes, out_row_bytes, cursor);
    r += m;
  }
  _tile_release();
}

inline void amx_item(const Group& g, int64_t nblocks, const c10::BFloat16* x, int64_t ldx,
                     int64_t r0, int64_t r1, char* out, int64_t out_row_bytes, const char* pf,
                     const char* pf_end) {
  switch (nblocks) {
    case 4: return amx_item<4>(g, x, ldx, r0, r1, out, out_row_bytes, pf, pf_end);
    case 3: return amx_item<3>(g, x, ldx, r0, r1, out, out_row_bytes, pf, pf_end);
    case 2: return amx_item<2>(g, x, ldx, r0, r1, out, out_row_bytes, pf, pf_end);
    default: return amx_item<1>(g, x, ldx, r0, r1, out, out_row_bytes, pf, pf_end);
  }
}

bool amx_usable(int64_t k) { return k % 32 == 0 && use_amx(); }
#else
constexpr int64_t amx_row_block(int64_t) { return kRowBlock; }
bool amx_usable(int64_t) { return false; }
#endif
}  // namespace

bool has_bf16_linear() { return true; }

#ifdef INFER_AMX
namespace {
bool amx_enabled = true;  // set_amx: tests and benchmarks compare the kernels

// Linux hands out the tile registers' state only on request, once per process.
bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}
}  // namespace

bool set_amx(bool on) {
  amx_enabled = on && amx_permitted();
  return amx_enabled;
}

bool use_amx() { return amx_enabled && amx_permitted(); }
#else
bool set_amx(bool) { return false; }

bool use_amx() { return false; }
#endif

at::Tensor pack_bf16_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be a bf16 [N, K]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "K must be even");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = (n + kLanes - 1) / kLanes;
  auto w = weight.contiguous();
  auto packed = at::zeros({blocks, k / 2, kLanes, 2}, weight.options());
  const auto* src = w.data_ptr<c10::BFloat16>();
  auto* dst = packed.data_ptr<c10::BFloat16>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t b = col / kLanes, lane = col % kLanes;
    for (int64_t kk = 0; kk < k; ++kk)
      dst[((b * (k / 2) + kk / 2) * kLanes + lane) * 2 + kk % 2] = src[col * k + kk];
  }
  return packed;
}

namespace {

// x @ W.T + bias, or with an activation act(gate) * up of the gated weight's halves.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, bool out_float, Act act) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "x and the packed weight must be bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2,
              "weight must be packed by pack_bf16_linear");
  const int64_t k = x.size(-1), k_pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(k == 2 * k_pairs, "x's last axis does not match the weight");
  TORCH_CHECK(out_features <= blocks * kLanes && out_features > (blocks - 1) * kLanes,
              "out_features does not match the weight");
  TORCH_CHECK(x.stride(-1) == 1, "x rows must be contiguous");
  auto x2 = x.reshape({-1, k});
  if (x2.stride(0) != k) x2 = x2.contiguous();
  const int64_t rows = x2.size(0);
  // A gated weight's groups are 32 gate then 32 up columns; its output is half as wide.
  const int64_t width = gated(act) ? out_features / 2 : out_features;
  TORCH_CHECK(!gated(act) || out_features % (kCols * kLanes) == 0,
              "a gated weight needs a multiple of 64 output features");
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == out_features, "bias must be [out_features]");
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t elem = out_float ? 4 : 2, block_stride = k_pairs * 2 * kLanes;
  const int64_t groups = (blocks + kCols - 1) / kCols;
  // Work items: (block of 64 rows, group of 64 columns), row blocks outermost so that both
  // threads stream the weights past the same rows. Each thread runs its own share of items in
  // order (parallel_owned), so it knows its next one: its tiles prefetch that item's weights
  // into L2, spread over the tiles as far as a line per k pair allows. The weights then come
  // from memory while this item computes, not stalling the next item's first tile.
  const bool amx = amx_usable(k);
  const int64_t row_block = amx ? amx_row_block(k) : kRowBlock;
  const int64_t row_blocks = (rows + row_block - 1) / row_block;
  // An odd number of groups leaves one thread a whole group more than the other in a row
  // block (the model's o and down projections have 9, qkv 15). The AVX512 kernel splits the
  // last group of a plain linear into two 32-column items (6 x 2 tiles) and puts them in the
  // middle of the row block's items, where two threads' shares meet: each thread gets half
  // of it. AMX items stay whole.
  const bool split = !amx && !gated(act) && groups % 2 == 1 && blocks % kCols == 0 &&
                     at::get_num_threads() == 2;
  const int64_t per_block = groups + (split ? 1 : 0), middle = per_block / 2;
  struct Span {
    int64_t r0, group, b0, b1;  // rows from r0; packed blocks [b0, b1) of the group
  };
  auto locate = [&](int64_t i) {
    const int64_t j = i % per_block, r0 = i / per_block * row_block;
    if (!split) return Span{r0, j, 0, std::min(kCols, blocks - j * kCols)};
    if (j == middle - 1) return Span{r0, groups - 1, 0, kCols / 2};
    if (j == middle) return Span{r0, groups - 1, kCols / 2, kCols};
    return Span{r0, j < middle ? j : j - 2, 0, kCols};
  };
  auto work = [&](int64_t i, int64_t next) {
    const Span at = locate(i);
    const int64_t r0 = at.r0, r1 = std::min(rows, r0 + row_block);
    const int64_t first = at.group * kCols + at.b0, nblocks = at.b1 - at.b0;
    const int64_t col = first * kLanes;
    const int64_t tiles = (r1 - r0 + kRows - 1) / kRows;
    Group g{wp + first * block_stride, block_stride, k_pairs, bp ? bp + col : nullptr,
            out_features - col, width, out_float, 1, act};
    const int64_t out_col = gated(act) ? col / 2 : col;
    const char* pf = nullptr;
    const char* pf_end = nullptr;
    int64_t pf_per_tile = 0;
    if (next >= 0) {
      const Span to = locate(next);
      if (to.group != at.group || to.b0 != at.b0) {
        pf = reinterpret_cast<const char*>(wp + (to.group * kCols + to.b0) * block_stride);
        pf_end = pf + (to.b1 - to.b0) * block_stride * 2;
        const int64_t lines = (to.b1 - to.b0) * block_stride * 2 / 64;
        g.pf_every = std::max<int64_t>(1, k_pairs * tiles / lines);
        pf_per_tile = k_pairs / g.pf_every;
      }
    }
#ifdef INFER_AMX
    if (amx) {
      amx_item(g, nblocks, xp, k, r0, r1, op + out_col * elem, width * elem, pf, pf_end);
      return;
    }
#else
    (void)pf_end;
#endif
    for (int64_t r = r0, t = 0; r < r1; r += kRows, ++t) {
      const int64_t nr = std::min(kRows, r1 - r);
      void* o = op + (r * width + out_col) * elem;
      const auto* xr = xp + r * k;
      const char* tpf = pf ? pf + t * pf_per_tile * 64 : nullptr;
      switch (nblocks) {
        case 4: rows_tile<4>(nr, g, xr, k, o, tpf); break;
        case 3: rows_tile<3>(nr, g, xr, k, o, tpf); break;
        case 2: rows_tile<2>(nr, g, xr, k, o, tpf); break;
        default: rows_tile<1>(nr, g, xr, k, o, tpf); break;
      }
    }
  };
  parallel_owned(per_block * row_blocks, work);
  return out;
}

}  // namespace

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool out_float) {
  return linear(x, packed, out_features, bias, out_float, kNone);
}

at::Tensor bf16_gated_linear(const at::Tensor& x, const at::Tensor& packed, int64_t width,
                             const c10::optional<at::Tensor>& bias, bool gelu) {
  return linear(x, packed, 2 * width, bias, false, gelu ? kGelu : kSilu);
}

at::Tensor bf16_gelu_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const c10::optional<at::Tensor>& bias) {
  return linear(x, packed, out_features, bias, false, kGeluErf);
}

#else  // no AVX512-BF16 on this CPU: the model keeps oneDNN's linears

bool has_bf16_linear() { return false; }

bool set_amx(bool) { return false; }

bool use_amx() { return false; }

at::Tensor pack_bf16_linear(const at::Tensor&) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, int64_t,
                       const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

at::Tensor bf16_gated_linear(const at::Tensor&, const at::Tensor&, int64_t,
                             const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

at::Tensor bf16_gelu_linear(const at::Tensor&, const at::Tensor&, int64_t,
                            const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

#endif
