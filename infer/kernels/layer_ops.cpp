// The elementwise parts of a decoder layer, each one pass over its rows: RMSNorm (with the
// residual add folded in), rotary embedding plus the KV-cache write, and the gated
// activation; and the lookup of a quantized embedding table. In eager torch each of these is
// 3 to 8 ops with bf16 <-> float copies in between; at decode sizes that per-op cost, not
// arithmetic, was a third of a step.
//
// Rounding follows torch's eager ops where a test compares them: a bf16 RMSNorm rounds the
// normalized row before the weight multiplies it (as aten's rms_norm does); Gemma's
// (1 + w) form rounds once at the end.
#include <ATen/ATen.h>
#include <type_traits>

#include "ops.h"
#include "vec.h"

namespace {

template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps, float offset) {
  float ss = 0.f;
_Pragma("omp simd reduction(+ : ss)")
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (offset == 0.f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
      out[i] = from_float<T>(to_float(from_float<T>(to_float(x[i]) * r)) * to_float(w[i]));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
      out[i] = from_float<T>(to_float(x[i]) * r * (offset + to_float(w[i])));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0) && weight.is_contiguous(),
              "weight must be [hidden] like x's last axis");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_rows(x, weight);
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    for_range(rows, rows * n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps),
                 static_cast<float>(offset));
    });
  });
  return out;
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                  double offset) {
  check_rows(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must be a contiguous tensor shaped like x");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    auto* xp = x.data_ptr<scalar_t>();
    auto* rp = residual.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    for_range(rows, rows * n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res = rp + r * n;
        const scalar_t* add = xp + r * n;
_Pragma("omp simd")
        for (int64_t i = 0; i < n; ++i)
          res[i] = from_float<scalar_t>(to_float(res[i]) + to_float(add[i]));
        norm_row(res, wp, xp + r * n, n, static_cast<float>(eps), static_cast<float>(offset));
      }
    });
  });
}

CacheStrides cache_strides(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const at::Tensor& k = k_cache;
  const at::Tensor& v = v_cache;
  TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.size(4) == 2 && v.size(4) == 2 &&
                  v.size(0) == k.size(0) && v.size(1) == k.size(1) &&
                  v.size(3) == k.size(2) * 2 && v.size(2) * 2 == k.size(3) &&
                  k.scalar_type() == v.scalar_type(),
              "caches must be [blocks, kv_heads, head_dim / 2, block, 2] and [blocks, "
              "kv_heads, block / 2, head_dim, 2] of one dtype");
  const int64_t blocks = k.size(0), kv = k.size(1), dim = v.size(3), block = k.size(3);
  const int64_t slab = dim * block;
  const bool slabs = k.stride(4) == 1 && k.stride(3) == 2 && k.stride(2) == 2 * block &&
                     v.stride(4) == 1 && v.stride(3) == 2 && v.stride(2) == 2 * dim &&
                     k.stride(0) == v.stride(0) && k.stride(1) == v.stride(1);
  const int64_t sb = k.stride(0), sh = k.stride(1);
  const bool block_major = (kv == 1 || sh == slab) && (blocks == 1 || sb == kv * slab);
  const bool head_major = (blocks == 1 || sb == slab) && (kv == 1 || sh == blocks * slab);
  TORCH_CHECK(slabs && (block_major || head_major),
              "caches must hold each (block, kv head) contiguously, block-major or head-major, "
              "the same way in keys and values");
  return {sb, sh};
}

void rope_and_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t num_heads, int64_t num_kv_heads, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [N, width]");
  const int64_t tokens = qkv.size(0), heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(heads > 0 && qkv.size(1) % heads == 0, "qkv width must be heads * head_dim");
  const int64_t dim = qkv.size(1) / heads, half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  sin.sizes() == cos.sizes() && cos.size(0) == tokens && cos.size(1) == half,
              "cos and sin must be contiguous float32 [N, head_dim / 2]");
  const CacheStrides st = cache_strides(k_cache, v_cache);
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && k_cache.size(2) * 2 == dim &&
                  k_cache.scalar_type() == qkv.scalar_type(),
              "caches must be [blocks, kv_heads, head_dim / 2, block, 2] and [blocks, "
              "kv_heads, block / 2, head_dim, 2] of qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [N]");
  const int64_t block = k_cache.size(3), capacity = k_cache.size(0) * block;
  const auto* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " is outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope", [&] {
    auto* base = qkv.data_ptr<scalar_t>();
    auto* kc = k_cache.data_ptr<scalar_t>();
    auto* vc = v_cache.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    for_range(tokens, tokens * heads * dim, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = base + t * heads * dim;
        const float* c = cp + t * half;
        const float* s = sp + t * half;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          scalar_t* x = row + h * dim;
_Pragma("omp simd")
          for (int64_t i = 0; i < half; ++i) {
            const float a = to_float(x[i]), b = to_float(x[i + half]);
            x[i] = from_float<scalar_t>(a * c[i] - b * s[i]);
            x[i + half] = from_float<scalar_t>(b * c[i] + a * s[i]);
          }
        }
        if (slot[t] < 0) continue;
        const int64_t blk = slot[t] / block, off = slot[t] % block;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const scalar_t* key = row + (num_heads + h) * dim;
          const scalar_t* value = row + (num_heads + num_kv_heads + h) * dim;
          // Keys [D/2, block, 2], values [block/2, D, 2] (see PagedKVCache).
          scalar_t* kdst = kc + st.of(blk, h) + 2 * off;
          scalar_t* vdst = vc + st.of(blk, h) + (off - off % 2) * dim + off % 2;
          for (int64_t p = 0; p < half; ++p) {
            kdst[2 * p * block] = key[2 * p];
            kdst[2 * p * block + 1] = key[2 * p + 1];
          }
          for (int64_t i = 0; i < dim; ++i) vdst[2 * i] = value[i];
        }
      }
    });
  });
}

namespace {

template <typename T, bool kGelu>
void gate_rows(const T* in, T* out, int64_t width, int64_t begin, int64_t end) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // bf16 by hand, with the activations the gated linear applies in its tiles: GCC's
  // vectorization of the loop below was slow (figures in bench/results/LOG.md).
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * 2 * width;
      const T* u = g + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const __mmask16 m = lanes(width - i);
        const __m512 x = load_bf16(g + i, m);
        const __m512 y = _mm512_mul_ps(kGelu ? gelu_tanh16(x) : silu16(x), load_bf16(u + i, m));
        _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
    return;
  }
#endif
  for (int64_t r = begin; r < end; ++r) {
    const T* g = in + r * 2 * width;
    const T* u = g + width;
    T* o = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float x = to_float(g[i]);
      float act;
      if constexpr (kGelu) {
        const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        act = 0.5f * x * (2.f - 2.f / (fast_exp(2.f * y) + 1.f));  // 0.5x(1 + tanh y)
      } else {
        act = x / (1.f + fast_exp(-x));
      }
      o[i] = from_float<T>(act * to_float(u[i]));
    }
  }
}

}  // namespace

at::Tensor gated_activation(const at::Tensor& gate_up, bool gelu) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "gate_up must be contiguous [..., 2 * intermediate]");
  const int64_t width = gate_up.size(-1) / 2, rows = width ? gate_up.numel() / (2 * width) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "act", [&] {
    const auto* in = gate_up.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    for_range(rows, rows * width * 4, [&](int64_t begin, int64_t end) {
      if (gelu) {
        gate_rows<scalar_t, true>(in, op, width, begin, end);
      } else {
        gate_rows<scalar_t, false>(in, op, width, begin, end);
      }
    });
  });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be float32 [rows, n] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_range(rows, rows * n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * ld, n);
  });
  return out;
}

namespace {

// One row of a quantized table, as QuantTensor.dequantize computes it: per group, float32
// D*s and M*o, then (D*s)*u - (M*o), each product and difference rounded to float32 (no
// fused multiply-add, which would round once), then out's dtype.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void embed_row(
    const uint8_t* u, const int8_t* scale, const int8_t* offset, const at::Half* d,
    const at::Half* m, int64_t k, int64_t bits, int64_t group, int64_t supers_every, T* out) {
  for (int64_t g = 0; g < k / group; ++g) {
    const float s = static_cast<float>(d[g / supers_every]) * static_cast<float>(scale[g]);
    const float o = static_cast<float>(m[g / supers_every]) * static_cast<float>(offset[g]);
    T* dst = out + g * group;
    if (bits == 4) {  // two to a byte, the first in the low nibble
      const uint8_t* src = u + g * group / 2;
#pragma omp simd
      for (int64_t i = 0; i < group / 2; ++i) {
        dst[2 * i] = from_float<T>(s * static_cast<float>(src[i] & 15) - o);
        dst[2 * i + 1] = from_float<T>(s * static_cast<float>(src[i] >> 4) - o);
      }
    } else {
      const uint8_t* src = u + g * group;
#pragma omp simd
      for (int64_t i = 0; i < group; ++i) dst[i] = from_float<T>(s * static_cast<float>(src[i]) - o);
    }
  }
}

}  // namespace

at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& u, const at::Tensor& scale,
                           const at::Tensor& offset, const at::Tensor& d, const at::Tensor& m,
                           int64_t bits, int64_t group, int64_t supers_every,
                           at::ScalarType dtype) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be a contiguous int64 [N]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  const int64_t rows = u.size(0), stored = u.size(1), k = bits == 4 ? 2 * stored : stored;
  TORCH_CHECK(group > 0 && supers_every > 0 && k % group == 0, "k must be whole groups");
  const int64_t groups = k / group, supers = (groups + supers_every - 1) / supers_every;
  TORCH_CHECK(u.scalar_type() == at::kByte && u.dim() == 2 && u.is_contiguous() &&
                  scale.scalar_type() == at::kChar && offset.scalar_type() == at::kChar &&
                  scale.is_contiguous() && offset.is_contiguous() &&
                  scale.sizes() == at::IntArrayRef({rows, groups}) &&
                  offset.sizes() == scale.sizes() && d.scalar_type() == at::kHalf &&
                  m.scalar_type() == at::kHalf && d.is_contiguous() && m.is_contiguous() &&
                  d.size(0) == rows && d.size(1) >= supers && m.sizes() == d.sizes(),
              "the table must be QuantTensor's contiguous u, scale, offset, d and m");
  const int64_t n = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "token id ", id[i], " is outside the table");
  auto out = at::empty({n, k}, u.options().dtype(dtype));
  const int64_t ds = d.size(1);
  const uint8_t* up = u.data_ptr<uint8_t>();
  const int8_t* sp = scale.data_ptr<int8_t>();
  const int8_t* opp = offset.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_embedding", [&] {
    auto* op = out.data_ptr<scalar_t>();
    for_range(n, n * k, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = id[i];
        embed_row(up + r * stored, sp + r * groups, opp + r * groups, dp + r * ds, mp + r * ds,
                  k, bits, group, supers_every, op + i * k);
      }
    });
  });
  return out;
}
