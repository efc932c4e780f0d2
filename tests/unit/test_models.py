"""Our model code against transformers' own, on tiny random configs (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import transformers
from safetensors import safe_open

from infer import kernels
from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig
from infer.engine.params import SamplingParams
from infer.engine.request import Request
from infer.engine.runner import ModelRunner
from infer.engine.scheduler import PrefillChunk, SchedulerOutput
from infer.models.base import CausalLM
from infer.models.config import ModelConfig
from infer.models.context import AttnCapture
from infer.models.registry import create_model
from support.tiny import FAMILIES, VOCAB, tiny_reference

TOL = dict(atol=1e-4, rtol=1e-4)


# Beyond the shared tiny configs: three layers, and each family's harder cases (Llama 3's
# rope scaling; Qwen3 and Gemma3 with a head_dim other than hidden / heads; Gemma3's
# explicit layer pattern, query scale and final soft cap).
_FIELDS: dict[str, dict[str, Any]] = {
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    ),
    "qwen2": {},
    "qwen3": dict(head_dim=32),
    "gemma3": dict(
        head_dim=32,
        query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0,
    ),
}


def _reference(family: str) -> transformers.PreTrainedModel:
    fields = dict(num_hidden_layers=3, max_position_embeddings=256) | _FIELDS[family]
    return tiny_reference(family, **fields)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, our model loaded from its safetensors checkpoint)."""
    ref = _reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, safe_serialization=True)
    ours = _load_dir(path)
    return ref, ours


def _load_dir(path: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        weights = ((k, f.get_tensor(k)) for k in f.keys())
        return create_model(config, weights, dtype)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_logits_match_transformers(pair) -> None:
    ref, ours = pair
    ids = _ids(12)  # longer than Gemma's sliding window of 4
    expected = ref(ids).logits
    got = ours(ids, torch.arange(12)[None]).logits
    torch.testing.assert_close(got, expected, **TOL)


@torch.inference_mode()
def test_bf16_logits_follow_transformers(pair, tmp_path: Path) -> None:
    """In bf16 (where this CPU has AVX512-BF16: our linears, and the MLP's projection with
    its gate in one kernel), every position's logits stay within bf16's error of the float32
    reference, and the likeliest token agrees wherever the reference's top two are apart."""
    ref, _ = pair
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load_dir(tmp_path, torch.bfloat16)
    ids = _ids(12)
    expected = ref(ids).logits[0]
    got = ours(ids, torch.arange(12)[None]).logits[0].float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 0.03 * scale
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.06 * scale
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def _runner(model: CausalLM, block_size: int = 4) -> tuple[ModelRunner, BlockManager]:
    blocks = BlockManager(24, block_size, prefix_caching=False)
    blocks.ensure("someone-else", 3 * block_size)  # so that tables are not 0, 1, 2...
    return ModelRunner(model, EngineConfig(max_seq_len=32, max_batch_size=2), blocks), blocks


def _request(name: str, ids: torch.Tensor, blocks: BlockManager) -> Request:
    req = Request(name, ids[0].tolist(), SamplingParams())
    req.prefill_len = req.prompt_len
    blocks.ensure(name, 32)
    return req


@torch.inference_mode()
def test_chunked_prefill_and_decode_over_paged_cache_equal_uncached_forward(pair) -> None:
    _, ours = pair
    ids = _ids(14)
    full = ours(ids, torch.arange(14)[None]).logits[0]
    runner, blocks = _runner(ours)
    req = _request("a", ids[:, :9], blocks)
    runner.run(SchedulerOutput(prefill=[PrefillChunk(req, 0, 5)]))  # no logits: not done
    out = runner.run(SchedulerOutput(prefill=[PrefillChunk(req, 5, 4)]))  # reads blocks
    assert out.logits is not None
    torch.testing.assert_close(out.logits[0], full[8], **TOL)
    for pos in range(9, 14):
        req.output_ids.append(int(ids[0, pos]))
        step = runner.run(SchedulerOutput(decode=[req]))
        assert step.logits is not None
        torch.testing.assert_close(step.logits[0], full[pos], **TOL)


@torch.inference_mode()
def test_prompt_rows_of_a_scored_prompt_equal_uncached_forward(pair) -> None:
    """A request that scores its prompt gets the logits of every prompt position, chunk by
    chunk, beside another prompt (its kept rows are the whole of its chunk, out of batch
    order: the finishing row first)."""
    _, ours = pair
    ids, other = _ids(11, seed=3), _ids(5, seed=4)
    full = ours(ids, torch.arange(11)[None]).logits[0]
    runner, blocks = _runner(ours)
    req = _request("a", ids, blocks)
    req.params = SamplingParams(prompt_logprobs=2)
    b = _request("b", other, blocks)
    first = runner.run(SchedulerOutput(prefill=[PrefillChunk(req, 0, 6), PrefillChunk(b, 0, 5)]))
    req.prompt_scores += [None] * 6  # type: ignore[list-item]  # what the engine adds
    last = runner.run(SchedulerOutput(prefill=[PrefillChunk(req, 6, 5)]))
    [part1], [part2] = first.prompt_rows, last.prompt_rows
    assert (part1.start, part2.start) == (0, 6) and last.requests == [req]
    rows = torch.cat([part1.logits, part2.logits])  # positions 0..9 score tokens 1..10
    torch.testing.assert_close(rows, full[:10], **TOL)
    assert last.logits is not None
    torch.testing.assert_close(last.logits[0], full[10], **TOL)
    assert first.logits is not None and first.requests == [b]


@torch.inference_mode()
def test_a_sequences_logits_do_not_depend_on_what_shares_its_step(pair) -> None:
    """Bit for bit, in float32: a prompt's one-token last chunk alone in its step and beside
    another prompt's partial chunk (the last layer, which finishes only the rows that get
    logits, takes the same kernels for it either way); then its next token decoded alone
    and beside another sequence (Qwen3's and Gemma3's q/k norms took another path at one
    row than at several)."""
    _, ours = pair
    ids, other = _ids(9, seed=6), _ids(12, seed=7)
    runner, blocks = _runner(ours)
    a = _request("a", ids, blocks)
    runner.run(SchedulerOutput(prefill=[PrefillChunk(a, 0, 8)]))
    alone = runner.run(SchedulerOutput(prefill=[PrefillChunk(a, 8, 1)])).logits
    a.output_ids.append(5)
    alone_decode = runner.run(SchedulerOutput(decode=[a])).logits
    runner, blocks = _runner(ours)
    a, b = _request("a", ids, blocks), _request("b", other, blocks)
    runner.run(SchedulerOutput(prefill=[PrefillChunk(a, 0, 8)]))
    beside = runner.run(SchedulerOutput(prefill=[PrefillChunk(a, 8, 1), PrefillChunk(b, 0, 6)]))
    assert alone is not None and beside.logits is not None and beside.requests == [a]
    assert torch.equal(alone, beside.logits)
    runner.run(SchedulerOutput(prefill=[PrefillChunk(b, 6, 6)]))
    a.output_ids.append(5)
    b.output_ids.append(7)
    both = runner.run(SchedulerOutput(decode=[a, b])).logits
    assert alone_decode is not None and both is not None
    assert torch.equal(alone_decode[0], both[0])


@pytest.mark.skipif(not kernels.has_bf16(), reason="the decode stack needs AVX512-BF16")
@torch.inference_mode()
def test_decode_steps_in_one_kernel_call_equal_the_layer_by_layer_forward(
    pair, tmp_path: Path
) -> None:
    """In bf16, a decode-only step runs every layer in one C++ call (DecodeStack); its
    logits are bit for bit those of the layers called one by one, step after step (Gemma3:
    past its sliding window)."""
    ref, _ = pair
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load_dir(tmp_path, torch.bfloat16)
    stack = ours.decode_stack
    assert stack is not None
    spy = mock.Mock(wraps=stack)
    logits = {}
    for fused in (True, False):
        ours.decode_stack = spy if fused else None
        runner, blocks = _runner(ours)
        a, b = _request("a", _ids(9, seed=2), blocks), _request("b", _ids(5, seed=3), blocks)
        runner.run(SchedulerOutput(prefill=[PrefillChunk(a, 0, 9), PrefillChunk(b, 0, 5)]))
        steps = []
        for token in (3, 50, 17):
            a.output_ids.append(token)
            b.output_ids.append(token + 1)
            out = runner.run(SchedulerOutput(decode=[a, b]))
            assert out.logits is not None
            steps.append(out.logits)
        logits[fused] = torch.stack(steps)
    ours.decode_stack = stack
    assert spy.call_count == 3  # the decode steps, not the prefill
    assert torch.equal(logits[True], logits[False])


@torch.inference_mode()
def test_right_padded_batch_equals_each_alone(pair) -> None:
    _, ours = pair
    a, b = _ids(5, seed=2)[0], _ids(9, seed=3)[0]
    alone_a = ours(a[None], torch.arange(5)[None]).logits[0]
    alone_b = ours(b[None], torch.arange(9)[None]).logits[0]
    ids = torch.stack([torch.cat([a, torch.zeros(4, dtype=torch.long)]), b])
    pos = torch.tensor([list(range(5)) + [-1] * 4, list(range(9))])
    got = ours(ids, pos).logits
    torch.testing.assert_close(got[0, :5], alone_a, **TOL)
    torch.testing.assert_close(got[1], alone_b, **TOL)
    last = ours(ids, pos, logits_index=torch.tensor([4, 8])).logits  # [B, V]
    torch.testing.assert_close(last, torch.stack([alone_a[4], alone_b[8]]), **TOL)


@torch.inference_mode()
def test_sequences_at_different_positions_share_one_packed_forward(pair) -> None:
    _, ours = pair
    a, b = _ids(11, seed=4), _ids(6, seed=5)
    full_a = ours(a, torch.arange(11)[None]).logits[0]
    full_b = ours(b, torch.arange(6)[None]).logits[0]
    runner, blocks = _runner(ours)
    ra, rb = _request("a", a[:, :10], blocks), _request("b", b[:, :5], blocks)
    both = runner.run(SchedulerOutput(prefill=[PrefillChunk(ra, 0, 10), PrefillChunk(rb, 0, 5)]))
    assert both.logits is not None and both.requests == [ra, rb]
    torch.testing.assert_close(both.logits[0], full_a[9], **TOL)
    torch.testing.assert_close(both.logits[1], full_b[4], **TOL)
    ra.output_ids.append(int(a[0, 10]))
    rb.output_ids.append(int(b[0, 5]))
    step = runner.run(SchedulerOutput(decode=[ra, rb])).logits  # kernel: two lengths
    assert step is not None
    torch.testing.assert_close(step[0], full_a[10], **TOL)
    torch.testing.assert_close(step[1], full_b[5], **TOL)


@torch.inference_mode()
def test_attention_capture_matches_transformers(pair) -> None:
    ref, ours = pair
    ids = _ids(8)
    expected = ref(ids, output_attentions=True).attentions[1][0]  # layer 1: [H, T, T]
    out = ours(ids, torch.arange(8)[None], capture=AttnCapture(frozenset({1})))
    assert out.attn is not None and set(out.attn) == {1}
    torch.testing.assert_close(out.attn[1][0], expected, **TOL)
    torch.testing.assert_close(out.attn[1].sum(-1), torch.ones(1, 4, 8), **TOL)
    plain = ours(ids, torch.arange(8)[None]).logits
    torch.testing.assert_close(out.logits, plain, **TOL)  # capturing changes nothing


def test_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported architecture.*MambaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["MambaForCausalLM"]})


def test_missing_weight_is_named() -> None:
    ref = _reference("llama")
    weights = [(k, v) for k, v in ref.state_dict().items() if "layers.1.mlp.up_proj" not in k]
    config = ModelConfig.from_hf(ref.config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj"):
        create_model(config, weights, torch.float32)


@torch.inference_mode()
def test_engine_batches_every_family_like_each_alone(pair, default_tokenizer) -> None:
    """Llama, Qwen3 (q/k norms) and Gemma3 (sliding window, soft cap) through the engine:
    paged prefill, the decode kernel, a request joining mid-flight."""
    from infer.engine.engine import Engine

    _, ours = pair
    prompts = [_ids(n, seed=10 + n)[0].tolist() for n in (3, 9, 14)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    config = EngineConfig(max_batch_size=4, max_seq_len=32, block_size=4)

    alone = []
    for p in prompts:
        engine = Engine.from_components(config, ours, default_tokenizer, [])
        req = engine.add_request(p, params)
        while engine.has_work():
            engine.step()
        alone.append(req.output_ids)
    engine = Engine.from_components(config, ours, default_tokenizer, [])
    first = [engine.add_request(p, params) for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    late = engine.add_request(prompts[2], params)  # joins while the others decode
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in [*first, late]] == alone
