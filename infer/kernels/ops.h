// The kernels' entry points (bound to Python in bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include <string>

// A layer's paged KV cache, as every attention kernel reads it: keys [blocks, kv_heads,
// head_dim / 2, block, 2] and values [blocks, kv_heads, block / 2, head_dim, 2] (see
// PagedKVCache), of one dtype. Each (block, head) slab of head_dim * block values is
// contiguous; the slabs may lie block-major or head-major (PagedKVCache keeps each head's
// blocks together, so that one sequence's keys are one stream), the same way in both tensors.
// Returns the distance between blocks and between heads, in elements.
struct CacheStrides {
  int64_t block, head;
  // where the slab of block b, head h starts
  int64_t of(int64_t b, int64_t h) const { return b * block + h * head; }
};
CacheStrides cache_strides(const at::Tensor& k_cache, const at::Tensor& v_cache);

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset);

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                  double offset);

void rope_and_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t num_heads, int64_t num_kv_heads, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slots);

at::Tensor gated_activation(const at::Tensor& gate_up, bool gelu);

at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& u, const at::Tensor& scale,
                           const at::Tensor& offset, const at::Tensor& d, const at::Tensor& m,
                           int64_t bits, int64_t group, int64_t supers_every,
                           at::ScalarType dtype);

at::Tensor argmax_rows(const at::Tensor& x);

bool has_bf16_linear();
// Use AMX tiles in the bf16 linears and prefill attention where the CPU has them (the
// default); returns whether they are used.
bool set_amx(bool on);
// Whether the kernels use AMX tiles now (the CPU has them, Linux allows them, not turned off).
bool use_amx();

at::Tensor pack_bf16_linear(const at::Tensor& weight);

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool out_float);

at::Tensor bf16_gated_linear(const at::Tensor& x, const at::Tensor& packed, int64_t width,
                             const c10::optional<at::Tensor>& bias, bool gelu);

// erf-GELU(x @ W.T + bias) in bf16, the activation applied to the float accumulators (BERT's
// intermediate projection).
at::Tensor bf16_gelu_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const c10::optional<at::Tensor>& bias);

// Linears over weights packed by infer.models.quant (AVX512-VNNI, AVX-VNNI or AVX2; see
// quant_linear.cpp).
bool has_quant_linear();
// Which of those this build runs: "avx512vnni", "avxvnni", "avx2", or "" (none).
std::string quant_isa();

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool out_float);

at::Tensor quant_gated_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, bool gelu);

// Bidirectional attention of an encoder's right-padded rows: qkv [B, T, 3 * H * D] bf16,
// lengths int32 [B]; returns [B, T, H * D] bf16, zero in padding rows (encoder_attention.cpp).
at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& lengths, int64_t heads,
                             double scale);

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tables,
                             const at::Tensor& spans, double scale, int64_t window,
                             at::Tensor& out);

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows,
                       const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& penalty,
                       const at::Tensor& seen, const at::Tensor& seen_offsets,
                       const at::Tensor& uniform);

std::vector<at::Tensor> decode_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                                      const std::vector<at::Tensor>& caches,
                                      const std::vector<at::Tensor>& rope,
                                      const std::vector<int64_t>& windows,
                                      const at::Tensor& slots, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim,
                                      int64_t intermediate, double scale, double eps,
                                      double norm_offset, bool gelu);
