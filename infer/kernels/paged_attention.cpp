// Paged attention for decode on CPU: one query token per sequence, keys and values read
// straight from the block pool through each sequence's block table.
//
// SDPA over a padded, gathered cache spends most of its time on per-(batch, head) setup at
// these sizes (3 query heads per KV head, a few hundred positions); this reads each KV head
// of each sequence once, for its own length only, with every query head of its group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// bf16 is the top half of a float: widen with a shift the compiler vectorizes.
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// exp for softmax inputs (<= 0): 2^x split into integer and fraction parts, the fraction by
// a degree-5 polynomial (relative error ~2e-7). Written so that `omp simd` vectorizes it;
// std::exp stays scalar without -ffast-math, which would change the process's FP mode.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504088896341f;
  const float whole = std::floor(t);
  const float f = t - whole;
  const float p =
      1.f + f * (0.693147182f +
                 f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f +
                                                               f * 0.00133335581f))));
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   int64_t window, at::Tensor& out) {
  const int64_t n_seqs = q.size(0), n_heads = q.size(1), dim = q.size(2);
  const int64_t n_kv = k_cache.size(1), block = k_cache.size(2);
  const int64_t groups = n_heads / n_kv;
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const int64_t block_stride = n_kv * block * dim;

  at::parallel_for(0, n_seqs * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * dim), acc(groups * dim), row(dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / n_kv, h = item % n_kv;
      // With a sliding window the query sees only the last `window` positions: [first, end).
      const int64_t end = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      const int64_t len = end - first;
      if (len <= 0) continue;
      scores.resize(groups * len);
      for (int64_t g = 0; g < groups; ++g) {
        load_row(qp + s * q_stride + (h * groups + g) * dim, qf.data() + g * dim, dim);
        for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] *= static_cast<float>(scale);
      }
      const int32_t* table = tables + s * max_blocks;
      // Scores: every query head of the group against each key, one pass over the keys.
      for (int64_t pos = first; pos < end;) {
        const int64_t offset = pos % block, n = std::min(block - offset, end - pos);
        const T* keys = kp + table[pos / block] * block_stride + (h * block + offset) * dim;
        for (int64_t j = 0; j < n; ++j) {
          load_row(keys + j * dim, row.data(), dim);
          const float* r = row.data();
          for (int64_t g = 0; g < groups; ++g) {
            const float* qg = qf.data() + g * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; ++i) dot += qg[i] * r[i];
            scores[g * len + pos - first + j] = dot;
          }
        }
        pos += n;
      }
      std::vector<float> inv_sum(groups);
      for (int64_t g = 0; g < groups; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = exp_nonpositive(sg[t] - mx);
          sum += sg[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = first; pos < end;) {
        const int64_t offset = pos % block, n = std::min(block - offset, end - pos);
        const T* values = vp + table[pos / block] * block_stride + (h * block + offset) * dim;
        for (int64_t j = 0; j < n; ++j) {
          load_row(values + j * dim, row.data(), dim);
          const float* r = row.data();
          for (int64_t g = 0; g < groups; ++g) {
            const float w = scores[g * len + pos - first + j];
            float* ag = acc.data() + g * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) ag[i] += w * r[i];
          }
        }
        pos += n;
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* dst = op + s * o_stride + (h * groups + g) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<T>(acc[g * dim + i] * inv_sum[g]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [N, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [blocks, kv_heads, block_size, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head dims differ");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous [N, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous [N]");
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (one query token per sequence; window 0 = "
        "no sliding window)");
}
