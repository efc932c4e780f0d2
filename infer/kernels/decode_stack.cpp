// A decode step through every layer of the stack in one call.
//
// The same kernels, in the same order, as the Python layers (DecoderLayer, Attention,
// GatedMLP in infer/models/layers.py; Gemma3DecoderLayer in gemma3.py) run them, so the
// outputs are bit for bit the same: this file only saves the ~8 Python calls per layer, each
// a pybind dispatch, a GIL release and a GIL retake. Under a serving load the retake is what
// costs: the event loop holds the GIL while it writes tokens, and the engine thread waits
// for it after every kernel.
#include "ops.h"

namespace {

// Per layer, in this order (an empty tensor where a layer has none):
//   0 input norm (adds the previous layer's output to the residual first),
//   1, 2 qkv packed (bf16, or quantized: uint8) and bias, 3, 4 o packed and bias,
//   5 post-attention norm of the attention output (Gemma3),
//   6 pre-MLP norm (adds the attention output to the residual first),
//   7, 8 gate/up packed and bias, 9, 10 down packed and bias,
//   11 post-MLP norm of the MLP output (Gemma3),
//   12, 13 q and k norms (Qwen3, Gemma3).
constexpr int64_t kPerLayer = 14;

c10::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// A linear whose weight is bf16 packed (pack_bf16_linear) or quantized (uint8, quant.pack).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  if (w.scalar_type() == at::kByte) return quant_linear(x, w, bias, false);
  return bf16_linear(x, w, out_features, bias, false);
}

at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& w, int64_t width,
                        const c10::optional<at::Tensor>& bias, bool gelu) {
  if (w.scalar_type() == at::kByte) return quant_gated_linear(x, w, bias, gelu);
  return bf16_gated_linear(x, w, width, bias, gelu);
}

// The per-head norm of a strided view of the qkv rows, as RMSNorm.forward does it.
void norm_heads(at::Tensor heads, const at::Tensor& weight, double eps, double offset) {
  heads.copy_(rms_norm(heads.contiguous(), weight, eps, offset));
}

}  // namespace

std::vector<at::Tensor> decode_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                                      const std::vector<at::Tensor>& caches,
                                      const std::vector<at::Tensor>& rope,
                                      const std::vector<int64_t>& windows,
                                      const at::Tensor& slots, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim,
                                      int64_t intermediate, double scale, double eps,
                                      double norm_offset, bool gelu) {
  const auto layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [N, hidden]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(caches.size()) == layers * 2 &&
                  static_cast<int64_t>(rope.size()) == layers * 2 && layers > 0,
              "decode_layers: ", kPerLayer, " weights, 2 caches and cos/sin per layer");
  const int64_t n = x.size(0), hidden = x.size(1), heads = num_heads + 2 * num_kv_heads;
  const double off = norm_offset;
  at::Tensor residual, h;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kPerLayer];
    if (l == 0) {
      h = rms_norm(x, w[0], eps, off);
      residual = x;
    } else {
      add_rms_norm(x, residual, w[0], eps, off);
      h = x;
    }
    at::Tensor qkv = linear(h, w[1], heads * head_dim, maybe(w[2]));
    at::Tensor view = qkv.view({n, heads, head_dim});
    if (w[12].numel()) {
      norm_heads(view.slice(1, 0, num_heads), w[12], eps, off);
      norm_heads(view.slice(1, num_heads, num_heads + num_kv_heads), w[13], eps, off);
    }
    at::Tensor k_cache = caches[2 * l], v_cache = caches[2 * l + 1];
    rope_and_cache(qkv, rope[2 * l], rope[2 * l + 1], num_heads, num_kv_heads, k_cache,
                   v_cache, slots);
    at::Tensor attn = paged_decode_attention(view.slice(1, 0, num_heads), k_cache, v_cache,
                                             block_tables, seq_lens, scale, windows[l]);
    at::Tensor o = linear(attn.view({n, num_heads * head_dim}), w[3], hidden, maybe(w[4]));
    if (w[5].numel()) o = rms_norm(o, w[5], eps, off);
    add_rms_norm(o, residual, w[6], eps, off);
    at::Tensor gated = gated_linear(o, w[7], intermediate, maybe(w[8]), gelu);
    x = linear(gated, w[9], hidden, maybe(w[10]));
    if (w[11].numel()) x = rms_norm(x, w[11], eps, off);
  }
  return {x, residual};
}
