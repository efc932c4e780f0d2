// Causal attention of a prompt span over its sequence's keys, with AVX512-BF16.
//
// Queries at positions start .. start + T - 1 attend keys 0 .. their own position (within a
// sliding window when given). Keys and values are first repacked per KV head so that
// VDPBF16PS takes them two at a time along the reduction axis: keys as [S/16, D/2, 16, 2]
// (the linear kernel's weight layout, keys as output columns), values as [S/2, D, 2]. Then
// each (query head, block of 16 queries) computes its score rows with 16 register
// accumulators, an exact softmax per row in float, and P.V with P rounded to bf16, as
// torch's flash kernel also does. SDPA's CPU kernel ran at ~70 GFLOP/s on these shapes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kQ = 16;  // queries per work item, keys per score block

inline uint16_t bits_of(float x) { return from_float<c10::BFloat16>(x).x; }

// out[i][c0 .. c0 + 64) = sum over key pairs [jp0, jp1) of P[i] . V, for R query rows.
template <int R>
inline void pv_tile(const uint16_t* probs, int64_t ldp, const uint16_t* v, int64_t dim,
                    int64_t c0, int64_t jp0, int64_t jp1, uint16_t* out, int64_t ldo) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t jp = jp0; jp < jp1; ++jp) {
    const uint16_t* vrow = v + (jp * dim + c0) * 2;
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vrow + c * 32);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, probs + i * ldp + 2 * jp, sizeof(pair));
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv[c], pb);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + c0 + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[i][c]));
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, int64_t start, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "prefill_attention takes bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q is [T, H, D], k and v [K, S, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "head rows must be contiguous");
  const int64_t t = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv = k.size(0), s = k.size(1);
  TORCH_CHECK(v.size(0) == kv && v.size(1) == s && k.size(2) == dim && v.size(2) == dim,
              "k and v must be [K, S, D] like q's head size");
  TORCH_CHECK(heads % kv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(dim % 64 == 0, "head_dim must be a multiple of 64");
  TORCH_CHECK(start >= 0 && start + t <= s, "the span must end within the keys");
  const int64_t groups = heads / kv, pairs = dim / 2, blocks = (s + kQ - 1) / kQ;
  const int64_t padded = blocks * kQ;
  // Repack: kp[h][block][d pair][16][2], vp[h][key pair][d][2] (padding is zero).
  auto kp = at::zeros({kv, blocks, pairs, kQ, 2}, q.options());
  auto vp = at::zeros({kv, padded / 2, dim, 2}, q.options());
  {
    auto* kd = reinterpret_cast<uint16_t*>(kp.data_ptr<c10::BFloat16>());
    auto* vd = reinterpret_cast<uint16_t*>(vp.data_ptr<c10::BFloat16>());
    const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>());
    const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>());
    for_range(kv * s, kv * s * dim, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / s, j = item % s;
        const uint16_t* key = ks + h * k.stride(0) + j * k.stride(1);
        const uint16_t* value = vs + h * v.stride(0) + j * v.stride(1);
        uint16_t* kdst = kd + ((h * blocks + j / kQ) * pairs) * kQ * 2 + (j % kQ) * 2;
        for (int64_t p = 0; p < pairs; ++p) {
          kdst[p * kQ * 2] = key[2 * p];
          kdst[p * kQ * 2 + 1] = key[2 * p + 1];
        }
        uint16_t* vdst = vd + ((h * (padded / 2) + j / 2) * dim) * 2 + (j % 2);
        for (int64_t d = 0; d < dim; ++d) vdst[2 * d] = value[d];
      }
    });
  }
  auto out = at::empty({t, heads, dim}, q.options());
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(kp.data_ptr<c10::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(vp.data_ptr<c10::BFloat16>());
  const int64_t q_blocks = (t + kQ - 1) / kQ;
  const float fscale = static_cast<float>(scale);
  // A short span (a chat prompt: tens of tokens) is a few microseconds of work per head:
  // less than waking the second thread, so it runs in this one.
  const int64_t flops = 2 * t * (window > 0 ? std::min(window, s) : s) * heads * dim;
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kQ * padded);
    std::vector<uint16_t> probs(kQ * padded);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t hq = item / q_blocks, r0 = (item % q_blocks) * kQ;
      const int64_t h = hq / groups, rows = std::min(kQ, t - r0);
      const int64_t last = start + r0 + rows - 1;  // the block's last query position
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + r0 - window + 1) : 0;
      const int64_t b0 = lo / kQ, b1 = last / kQ + 1;  // key blocks [b0, b1)
      const int32_t* qrow[kQ];
      for (int64_t r = 0; r < kQ; ++r) {
        const int64_t row = r0 + std::min(r, rows - 1);
        qrow[r] = reinterpret_cast<const int32_t*>(qd + row * q.stride(0) + hq * dim);
      }
      // Scores: one accumulator per query row, 16 keys wide.
      for (int64_t b = b0; b < b1; ++b) {
        __m512 acc[kQ];
        for (int64_t r = 0; r < kQ; ++r) acc[r] = _mm512_setzero_ps();
        const uint16_t* kb = kd + ((h * blocks + b) * pairs) * kQ * 2;
        for (int64_t p = 0; p < pairs; ++p) {
          const __m512bh kvec = (__m512bh)_mm512_loadu_si512(kb + p * kQ * 2);
          for (int64_t r = 0; r < kQ; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], kvec, (__m512bh)_mm512_set1_epi32(qrow[r][p]));
        }
        for (int64_t r = 0; r < kQ; ++r)
          _mm512_storeu_ps(scores.data() + r * padded + b * kQ,
                           _mm512_mul_ps(acc[r], _mm512_set1_ps(fscale)));
      }
      // Exact softmax per row over its own keys; P in bf16, zero outside them.
      const int64_t k0 = b0 * kQ, k1 = b1 * kQ;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = start + r0 + r;
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        float* sr = scores.data() + r * padded;
        uint16_t* pr = probs.data() + r * padded;
        const float mx = row_max(sr + first, pos + 1 - first);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = first; j <= pos; ++j) {
          sr[j] = fast_exp(sr[j] - mx);
          sum += sr[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = k0; j < first; ++j) pr[j] = 0;
#pragma omp simd
        for (int64_t j = first; j <= pos; ++j) pr[j] = bits_of(sr[j] * inv);
        for (int64_t j = pos + 1; j < k1; ++j) pr[j] = 0;
      }
      // P.V: 4 rows x 64 columns of accumulators at a time.
      for (int64_t r = 0; r < rows; r += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - r);
        const uint16_t* pr = probs.data() + r * padded;
        uint16_t* orow = od + ((r0 + r) * heads + hq) * dim;
        const uint16_t* vh = vd + h * (padded / 2) * dim * 2;
        for (int64_t c0 = 0; c0 < dim; c0 += 64) {
          switch (nr) {
            case 4: pv_tile<4>(pr, padded, vh, dim, c0, k0 / 2, k1 / 2, orow, heads * dim); break;
            case 3: pv_tile<3>(pr, padded, vh, dim, c0, k0 / 2, k1 / 2, orow, heads * dim); break;
            case 2: pv_tile<2>(pr, padded, vh, dim, c0, k0 / 2, k1 / 2, orow, heads * dim); break;
            default: pv_tile<1>(pr, padded, vh, dim, c0, k0 / 2, k1 / 2, orow, heads * dim); break;
          }
        }
      }
    }
  };
  if (flops < (int64_t{1} << 24)) {
    work(0, heads * q_blocks);
  } else {
    at::parallel_for(0, heads * q_blocks, 1, work);
  }
  return out;
}

#else

at::Tensor prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             int64_t, int64_t) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16");
}

#endif
