"""The loader: Hugging Face dirs, GGUF files and the default-model cache, on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from huggingface_hub import constants as hub_constants
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers

from infer import cli, kernels
from infer.models import default
from infer.models.config import ModelConfig
from infer.models.derived_files import MARKER_NAME
from infer.models.linear import QuantLinear
from infer.models.loader import GGUFCheckpoint, LoadError, load_model
from infer.models.registry import create_model
from support.tiny import FAMILIES, VOCAB, tiny_reference

TOL = dict(atol=1e-4, rtol=1e-4)
RefDir = tuple[transformers.PreTrainedModel, Path]  # reference model, its saved directory


def _tiny_model(family: str) -> transformers.PreTrainedModel:
    # Gemma3 with six layers: llama.cpp's Gemma3 pattern makes every sixth layer global.
    layers = 6 if family == "gemma3" else 2
    return tiny_reference(family, num_hidden_layers=layers, eos_token_id=3)


def _save_tiny_tokenizer(path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "<pad>": 2, "</s>": 3} | {f"w{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> RefDir:
    """A tiny random Llama saved as a Hugging Face directory with a tokenizer."""
    ref = _tiny_model("llama")
    path = tmp_path_factory.mktemp("llama")
    ref.save_pretrained(path)
    _save_tiny_tokenizer(path)
    return ref, path


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return model(ids, positions).logits


def _ref_logits(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


IDS = torch.tensor([[1, 17, 42, 5, 88, 9, 23, 64, 7, 31]])


# --- errors: one line that names the problem ---------------------------------------------


def _check_error(source: str, *fragments: str) -> None:
    with pytest.raises(LoadError) as info:
        load_model(source, dtype=torch.float32)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def _check_cli_error(source: Path | str, capsys: pytest.CaptureFixture[str], fragment: str) -> None:
    capsys.readouterr()  # drop what setting up wrote (transformers' progress bars)
    status = cli.main(["generate", "--model", str(source), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("infer: error: ") and err.count("\n") == 1
    assert fragment in err and "Traceback" not in err


def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    _check_error(str(missing), "does not exist", str(missing))
    _check_cli_error(missing, capsys, "does not exist")


def test_dir_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    _check_error(str(tmp_path), "config.json", str(tmp_path))
    _check_cli_error(tmp_path, capsys, "config.json")


def test_truncated_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tiny_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    _check_error(str(tmp_path), "truncated", "model.safetensors")
    _check_cli_error(tmp_path, capsys, "truncated")


def test_unknown_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _check_error(str(tmp_path), "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")
    _check_cli_error(tmp_path, capsys, "GPT2LMHeadModel")


def test_missing_weights_file(tmp_path: Path) -> None:
    _tiny_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    _check_error(str(tmp_path), "neither model.safetensors nor model.safetensors.index.json")


def test_missing_weight_tensor(tmp_path: Path) -> None:
    ref = _tiny_model("llama")
    state = {k: v for k, v in ref.state_dict().items() if k != "model.norm.weight"}
    ref.save_pretrained(tmp_path, state_dict=state)
    _save_tiny_tokenizer(tmp_path)
    _check_error(str(tmp_path), "missing", "model.norm.weight")


def test_corrupt_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(60)))
    _check_error(str(bad), "not a readable GGUF file", str(bad))
    _check_cli_error(bad, capsys, "GGUF")


def test_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    _to_gguf(_tiny_model("llama"), "llama", path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    _check_error(str(path), "not a readable GGUF file")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _write_gguf(writer)
    _check_error(str(path), "'gpt2'", "llama", "qwen2", "qwen3", "gemma3")


def test_other_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    _check_error(str(path), "neither a model directory nor a .gguf file")


def test_hub_unreachable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    _check_error("infer-tests/no-such-model", "cannot download", "unreachable", "no-such-model")


def test_cli_rejects_bad_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked before the model loads, so this costs nothing.
    assert cli.main(["generate", "--prompt", "hi", "--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infer: error: top_p") and err.count("\n") == 1


# --- Hugging Face directories -------------------------------------------------------------


def test_hf_dir_matches_transformers(llama_dir: RefDir) -> None:
    ref, path = llama_dir
    loaded = load_model(str(path), dtype=torch.float32)
    assert loaded.name == path.name
    assert loaded.eos_token_ids == [3]
    assert loaded.chat_template is False
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer.encode("w5 w6", add_special_tokens=False) == [5, 6]
    torch.testing.assert_close(_logits(loaded.model, IDS), _ref_logits(ref, IDS), **TOL)


def test_sharded_hf_dir(tmp_path: Path, llama_dir: RefDir) -> None:
    ref, _ = llama_dir
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    _save_tiny_tokenizer(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    torch.testing.assert_close(_logits(loaded.model, IDS), _ref_logits(ref, IDS), **TOL)


def test_eos_ids_merge_generation_config(tmp_path: Path, llama_dir: RefDir) -> None:
    ref, _ = llama_dir
    ref.save_pretrained(tmp_path)
    _save_tiny_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    assert load_model(str(tmp_path), dtype=torch.float32).eos_token_ids == [7, 3]


@pytest.mark.skipif(not kernels.has_quant(), reason="no AVX2: weights stay dense")
@pytest.mark.parametrize(("weights", "tol"), [("int8", 0.02), ("int4", 0.25)])
def test_weights_quantized_at_load(llama_dir: RefDir, weights: str, tol: float) -> None:
    ref, path = llama_dir
    loaded = load_model(str(path), weights=weights)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert isinstance(layer.mlp.down_proj, QuantLinear)
    got, expected = _logits(loaded.model, IDS).float(), _ref_logits(ref, IDS)
    assert (got - expected).abs().max() < tol * expected.abs().max()


def test_dtype(llama_dir: RefDir) -> None:
    loaded = load_model(str(llama_dir[1]))
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


# --- GGUF: written the way llama.cpp's converter writes them, read back ------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _to_gguf(model: transformers.PreTrainedModel, family: str, path: Path) -> None:
    cfg = model.config
    arch = {
        "llama": gguf.MODEL_ARCH.LLAMA,
        "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3,
    }.get(family, gguf.MODEL_ARCH.GEMMA3)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if family not in ("llama", "qwen2"):
        writer.add_key_length(cfg.head_dim)
    if family == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_eos_token_id(cfg.eos_token_id)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        w = tensor.float().numpy().copy()
        if family == "llama" and stem.endswith("q_proj"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif family == "llama" and stem.endswith("k_proj"):
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        elif family == "gemma3" and stem.endswith("norm"):
            w = w + 1.0  # llama.cpp stores Gemma's norm scale as (1 + w)
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", w)
    _write_gguf(writer)


def _write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_matches_transformers(family: str, tmp_path: Path) -> None:
    ref = _tiny_model(family)
    path = tmp_path / f"{family}.gguf"
    _to_gguf(ref, family, path)
    checkpoint = GGUFCheckpoint(path)
    config = ModelConfig.from_hf(checkpoint.config)
    assert config.tie_word_embeddings == ref.config.tie_word_embeddings
    assert checkpoint.generation_config["eos_token_id"] == [3]
    assert [shape for _, shape in checkpoint.tensor_specs()] == [
        tuple(w.shape) for _, w in checkpoint.weights()
    ]
    ours = create_model(config, checkpoint.weights(), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _ref_logits(ref, IDS), **TOL)


# --- the default model's cache ------------------------------------------------------------


def test_write_safetensors_streams_in_order(tmp_path: Path) -> None:
    tensors = [("b", torch.randn(3, 5)), ("a", torch.randn(7)), ("c", torch.randn(2, 2, 2))]
    path = tmp_path / "t.safetensors"
    specs = [(name, tuple(t.shape)) for name, t in tensors]
    default.write_safetensors(path, specs, iter(tensors), torch.bfloat16)
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        for name, t in tensors:
            assert torch.equal(f.get_tensor(name), t.bfloat16())
    with pytest.raises(ValueError, match="does not match"):
        default.write_safetensors(path, specs, iter(tensors[::-1]), torch.float32)


def _fake_convert(fail: bool):
    def convert(source: Path, out_dir: Path, dtype: torch.dtype, desc: str = "") -> None:
        (out_dir / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-conversion

    return convert


def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default, "convert_gguf", _fake_convert(fail=True))
    with pytest.raises(KeyboardInterrupt):
        default.ensure_default_model()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(default, "convert_gguf", _fake_convert(fail=False))
    target = default.ensure_default_model()
    assert target == tmp_path / default.DEFAULT_MODEL_NAME
    assert sorted(p.name for p in target.iterdir()) == ["config.json", MARKER_NAME]
    assert [p.name for p in tmp_path.iterdir()] == [default.DEFAULT_MODEL_NAME]


def test_stale_cache_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    stale = tmp_path / default.DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / MARKER_NAME).write_text(json.dumps({"format": 0}))
    monkeypatch.setattr(default, "convert_gguf", _fake_convert(fail=False))
    assert default.ensure_default_model() == stale
    assert json.loads((stale / MARKER_NAME).read_text())["format"] == default.FORMAT
    assert [p.name for p in tmp_path.iterdir()] == [default.DEFAULT_MODEL_NAME]
    # A current cache is used as it is.
    monkeypatch.setattr(default, "convert_gguf", _fake_convert(fail=True))
    assert default.ensure_default_model() == stale


def test_unwritable_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(LoadError, match="INFER_CACHE_DIR"):
        default.ensure_default_model()
