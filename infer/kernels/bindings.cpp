// Python bindings of every kernel (one extension module).
#include <torch/extension.h>

#include "ops.h"

// Every kernel runs without the GIL (they touch no Python objects): the event loop thread
// keeps serving streams while the engine thread computes.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (one query token per sequence; window 0 = "
        "no sliding window)", NoGil());
  m.def("rms_norm", &rms_norm, "RMSNorm of rows: x * rsqrt(mean(x^2) + eps) * (offset + w)", NoGil());
  m.def("add_rms_norm", &add_rms_norm,
        "In place: residual += x, then x = rms_norm(residual) (one pass over both)", NoGil());
  m.def("rope_and_cache", &rope_and_cache,
        "In place: rotate the q and k heads of packed qkv rows, then store k and v in the "
        "paged cache at slots (block * block_size + offset; < 0: not stored)", NoGil());
  m.def("gated_activation", &gated_activation,
        "act(gate) * up of [N, 2I] rows: SiLU, or tanh-GELU when gelu", NoGil());
  m.def("quant_embedding", &quant_embedding,
        "Rows ids of a quantized table (QuantTensor's u, scale, offset, d, m), dequantized "
        "as QuantTensor.dequantize does, in dtype", NoGil());
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(x, dim=1) of float32 rows (first index on ties, NaN the largest)", NoGil());
  m.def("sample_rows", &sample_rows,
        "One token for each of the given rows of float32 logits [B, V]: repetition penalty "
        "over each row's seen ids (seen[offsets[i]:offsets[i + 1]]), temperature (0: "
        "argmax), top-k (0: all), top-p (1: all), then the draw at the row's uniform",
        NoGil());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Into out's span rows: causal attention of every prompt span of q [N, H, D] over its "
        "sequence in the paged cache (bf16, blocks of 16; spans int32 [S, 3] = offset, "
        "length, start; window 0 = none)", NoGil());
  m.def("encoder_attention", &encoder_attention,
        "Bidirectional attention of right-padded rows of a fused qkv [B, T, 3 * H * D] (bf16; "
        "row b's first lengths[b] tokens real): [B, T, H * D], padding rows 0", NoGil());
  m.def("set_amx", &set_amx,
        "use AMX tiles in the bf16 linears and prefill attention if the CPU has them; "
        "returns whether they are used", NoGil());
  m.def("has_bf16_linear", &has_bf16_linear, "whether this build has the AVX512-BF16 linear", NoGil());
  m.def("pack_bf16_linear", &pack_bf16_linear, "pack a bf16 [N, K] weight for bf16_linear", NoGil());
  m.def("bf16_linear", &bf16_linear, "x @ W.T + bias with a packed bf16 weight",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("out_float") = false, NoGil());
  m.def("bf16_gated_linear", &bf16_gated_linear,
        "act(x @ Wg.T + bg) * (x @ Wu.T + bu), [..., width] bf16, with a weight packed from the "
        "rows of gate and up taken 32 at a time in turn (SiLU, or tanh-GELU when gelu)",
        py::arg("x"), py::arg("packed"), py::arg("width"), py::arg("bias") = py::none(),
        py::arg("gelu") = false, NoGil());
  m.def("bf16_gelu_linear", &bf16_gelu_linear,
        "erf-GELU(x @ W.T + bias) in bf16 with a packed bf16 weight (the activation on the "
        "float accumulators)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        NoGil());
  m.def("has_quant_linear", &has_quant_linear,
        "whether this build has the quantized linears (AVX512-VNNI, AVX-VNNI or AVX2)", NoGil());
  m.def("quant_isa", &quant_isa,
        "the instructions the quantized linears use: avx512vnni, avxvnni, avx2, or '' (none)");
  m.def("quant_linear", &quant_linear,
        "x @ W.T + bias with a weight packed by infer.models.quant (x quantized per group)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::arg("out_float") = false, NoGil());
  m.def("quant_gated_linear", &quant_gated_linear,
        "act(x @ Wg.T + bg) * (x @ Wu.T + bu) with a quantized weight whose rows are gate and "
        "up 16 at a time in turn",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("gelu") = false,
        NoGil());
  m.def("decode_layers", &decode_layers,
        "A decode step (one token per sequence) through every layer of the stack with the "
        "kernels above, in the order the Python layers call them: (x, residual)",
        NoGil());
}
