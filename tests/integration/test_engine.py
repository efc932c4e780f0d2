"""The engine end to end on a tiny random Llama (fp32) with the real default tokenizer."""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref

import pytest
import torch

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.generate import generate
from infer.engine.params import SamplingParams
from infer.engine.request import Failure, FinishReason, StepOutput, TraceSpec

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True
)


def _engine(model, tokenizer, **kw) -> Engine:
    config = EngineConfig(**({"max_batch_size": 4, "max_seq_len": 256} | kw))
    return Engine.from_components(config, model, tokenizer, eos_token_ids=[])


def _run(engine: Engine, until: int | None = None) -> dict[str, list[StepOutput]]:
    """Step until idle (or ``until`` steps); outputs by request id."""
    outs: dict[str, list[StepOutput]] = {}
    steps = 0
    while engine.has_work() and (until is None or steps < until):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
    return outs


def _tokens(outs: list[StepOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def _text(outs: list[StepOutput]) -> str:
    return "".join(o.text_delta for o in outs)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "Once upon a time, in a land far far away, there lived a small dragon who " * 3,
    "1 2 3 4 5",
    "Bonjour, je m'appelle",
]


def _alone(model, tokenizer, prompt: str, params: SamplingParams) -> list[int]:
    engine = _engine(model, tokenizer)
    req = engine.add_request(prompt, params)
    return _tokens(_run(engine)[req.request_id])


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_batch_invariance(tiny_model, default_tokenizer, params, mode) -> None:
    alone = [_alone(tiny_model, default_tokenizer, p, params) for p in PROMPTS]
    engine = _engine(
        tiny_model,
        default_tokenizer,
        batching_mode=mode,
        batch_wait_timeout_s=0,
        prefill_token_budget=24,
    )
    reqs = [engine.add_request(p, params) for p in PROMPTS[:3]]
    outs = _run(engine, until=4)  # the first three are mid-flight when the others join
    reqs += [engine.add_request(p, params) for p in PROMPTS[3:]]
    for rid, more in _run(engine).items():
        outs.setdefault(rid, []).extend(more)
    for req, expected in zip(reqs, alone, strict=True):
        assert _tokens(outs[req.request_id]) == expected


def test_engine_matches_plain_generate(tiny_model, default_tokenizer) -> None:
    ids = default_tokenizer.encode(PROMPTS[0])
    assert list(generate(tiny_model, ids, GREEDY)) == _alone(
        tiny_model, default_tokenizer, PROMPTS[0], GREEDY
    )


def test_eos_ends_the_request(tiny_model, default_tokenizer) -> None:
    tokens = _alone(tiny_model, default_tokenizer, PROMPTS[0], GREEDY)
    eos = tokens[3]
    engine = Engine.from_components(
        EngineConfig(max_seq_len=256), tiny_model, default_tokenizer, eos_token_ids=[eos]
    )
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    req = engine.add_request(PROMPTS[0], params)
    outs = _run(engine)[req.request_id]
    assert _tokens(outs) == tokens[: tokens.index(eos) + 1]
    assert outs[-1].finished and outs[-1].outcome is FinishReason.EOS
    assert sum(o.finished for o in outs) == 1


def test_stop_string_split_across_tokens_never_reaches_the_client(
    tiny_model, default_tokenizer
) -> None:
    tokens = _alone(tiny_model, default_tokenizer, PROMPTS[0], SEEDED)
    pieces = [
        default_tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
        for i in range(len(tokens))
    ]
    full = pieces[-1]
    # A stop string made of the end of one token's text and the start of the next one's,
    # at its first occurrence in the output.
    cut = next(
        len(p)
        for p in pieces[1:-1]
        if len(p) >= 2 and full.find(full[len(p) - 2 : len(p) + 2]) == len(p) - 2
    )
    stop = full[cut - 2 : cut + 2]
    params = SamplingParams(**(vars(SEEDED) | {"stop": [stop]}))
    engine = _engine(tiny_model, default_tokenizer)
    req = engine.add_request(PROMPTS[0], params)
    outs = _run(engine)[req.request_id]
    assert _text(outs) == full[: cut - 2]
    assert outs[-1].outcome is FinishReason.STOP


def test_a_stop_string_that_is_a_special_tokens_text_stops_on_that_token(
    tiny_model, default_tokenizer
) -> None:
    """Special tokens never show in the text, so such a stop (``<|im_start|>``, as Continue
    sends for Qwen) ends the request on the token itself."""
    special = "<|im_start|>"
    token = default_tokenizer.convert_tokens_to_ids(special)
    engine = _engine(tiny_model, default_tokenizer)
    forced = SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias={token: 100.0})
    free = engine.add_request(PROMPTS[1], forced)
    stops = dataclasses.replace(forced, stop=[special, "zz"])
    stopped = engine.add_request(PROMPTS[1], stops)
    outs = _run(engine)
    assert _tokens(outs[free.request_id]) == [token] * 4
    assert _tokens(outs[stopped.request_id]) == [token]
    assert outs[stopped.request_id][-1].outcome is FinishReason.EOS
    assert stopped.params.stop == ["zz"] and token in stopped.params.stop_token_ids


def test_max_tokens_gives_length(tiny_model, default_tokenizer) -> None:
    engine = _engine(tiny_model, default_tokenizer)
    req = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=3, temperature=0.0))
    outs = _run(engine)[req.request_id]
    assert len(_tokens(outs)) == 3
    assert outs[-1].outcome is FinishReason.LENGTH and outs[-1].completion_tokens == 3


def test_abort_one_request_others_unaffected_and_slot_reused(tiny_model, default_tokenizer) -> None:
    expected = [_alone(tiny_model, default_tokenizer, p, GREEDY) for p in PROMPTS[:3]]
    engine = _engine(tiny_model, default_tokenizer, max_batch_size=2)
    a, b, c = (engine.add_request(p, GREEDY) for p in PROMPTS[:3])
    outs = _run(engine, until=3)
    assert engine.num_running == 2 and engine.num_waiting == 1
    aborted = engine.abort(a.request_id)  # at once: its slot is free for the next step
    assert aborted is not None and aborted.outcome is Failure.CANCELLED
    assert engine.abort(a.request_id) is None  # idempotent
    outs[a.request_id].append(aborted)
    for rid, more in _run(engine).items():
        outs.setdefault(rid, []).extend(more)
    assert sum(o.finished for o in outs[a.request_id]) == 1
    assert _tokens(outs[b.request_id]) == expected[1]
    assert _tokens(outs[c.request_id]) == expected[2]  # c took a's slot
    assert engine.blocks.num_used == 0


def test_failed_forward_fails_its_requests_and_engine_recovers(
    tiny_model, default_tokenizer, monkeypatch, caplog
) -> None:
    engine = _engine(tiny_model, default_tokenizer)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    _run(engine, until=2)

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated allocation failure")

    monkeypatch.setattr(tiny_model, "forward_paged", boom)
    with caplog.at_level(logging.ERROR, logger="infer"):
        outs = engine.step()
    assert {o.request_id for o in outs} == {r.request_id for r in reqs}
    assert all(o.finished and o.outcome is Failure.OUT_OF_MEMORY for o in outs)
    # The exception is logged, never put in an output a client could see.
    assert "simulated" in caplog.text and all(o.message is None for o in outs)
    monkeypatch.undo()
    assert not engine.has_work() and engine.blocks.num_used == 0
    req = engine.add_request(PROMPTS[0], GREEDY)
    assert _tokens(_run(engine)[req.request_id]) == _alone(
        tiny_model, default_tokenizer, PROMPTS[0], GREEDY
    )


def test_rejects_bad_requests_before_queueing(tiny_model, default_tokenizer) -> None:
    engine = _engine(tiny_model, default_tokenizer, max_seq_len=32)
    with pytest.raises(ValueError, match=r"max sequence length, 32 tokens \(--max-seq-len\)"):
        engine.add_request("hello " * 10, SamplingParams(max_new_tokens=30))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 10**9], GREEDY)
    with pytest.raises(ValueError, match="trace.layer"):
        engine.add_request("hi", GREEDY, trace=TraceSpec(layer=99))
    assert not engine.has_work()


def test_max_seq_len_is_the_models_context_unless_the_kv_cache_or_the_flag_says_less(
    tiny_model, default_tokenizer
) -> None:
    # The tiny model's context is 2048 tokens.
    engine = Engine.from_components(EngineConfig(max_batch_size=2), tiny_model, default_tokenizer)
    assert (engine.max_seq_len, engine.cache_size.bound) == (2048, "the model's context")
    assert engine.config.max_seq_len == 2048 and engine.blocks.num_blocks == 2 * 2048 // 16
    engine.check(2000, 48, None)
    with pytest.raises(
        ValueError, match=r"2048 tokens \(--max-seq-len; here the model's context\)"
    ):
        engine.check(2000, 49, None)
    small = EngineConfig(kv_cache_gb=48.5 * _block_bytes(tiny_model, 16) / 1e9)
    engine = Engine.from_components(small, tiny_model, default_tokenizer)
    assert (engine.max_seq_len, engine.cache_size.bound) == (768, "the KV cache budget")
    explicit = EngineConfig(max_seq_len=4096, max_batch_size=1)  # past the context: honoured
    engine = Engine.from_components(explicit, tiny_model, default_tokenizer)
    assert (engine.max_seq_len, engine.cache_size.bound) == (4096, "--max-seq-len")
    assert "beyond the model's context of 2048" in engine.cache_size.note
    with pytest.raises(ValueError, match="kv_cache_gb"):  # a set length the cache cannot hold
        Engine.from_components(
            EngineConfig(max_seq_len=1024, kv_cache_gb=small.kv_cache_gb),
            tiny_model,
            default_tokenizer,
        )


def test_no_leaks_after_500_mixed_requests(tiny_model, default_tokenizer) -> None:
    # A small KV budget (48 blocks of 4) so that prefix sharing, waiting for blocks and
    # preemption all happen along the way.
    engine = _engine(
        tiny_model,
        default_tokenizer,
        max_batch_size=8,
        max_waiting_requests=500,
        block_size=4,
        kv_cache_gb=48 * _block_bytes(tiny_model, 4) / 1e9,
        max_seq_len=64,
    )
    refs = []
    aborted = {}
    for i in range(500):
        params = SamplingParams(max_new_tokens=1 + i % 4, temperature=0.0)
        refs.append(weakref.ref(engine.add_request(PROMPTS[i % len(PROMPTS)], params)))
        if i % 7 == 0:
            out = engine.abort(f"req-{i}")
            assert out is not None
            aborted[out.request_id] = [out]
    outs = _run(engine) | aborted
    assert len(outs) == 500
    assert all(sum(o.finished for o in v) == 1 for v in outs.values())
    assert engine.blocks.hits > 0
    assert engine.blocks.num_used == 0 and not engine.blocks.tables
    assert not engine.scheduler.running and not engine.scheduler.waiting
    del outs
    gc.collect()
    assert all(r() is None for r in refs)


def test_traces_carry_topk_entropy_and_attention(tiny_model, default_tokenizer) -> None:
    from infer.engine.request import TraceSpec

    engine = _engine(tiny_model, default_tokenizer)
    req = engine.add_request(PROMPTS[0], GREEDY, trace=TraceSpec(top_k=3, layer=1))
    outs = _run(engine)[req.request_id]
    prompt_len = len(default_tokenizer.encode(PROMPTS[0]))
    for i, o in enumerate(outs):
        assert o.trace is not None and o.trace["entropy"] > 0
        top = o.trace["topk"]
        assert len(top) == 3 and top[0]["token_id"] == o.token_id  # greedy takes the top one
        assert top[0]["prob"] >= top[1]["prob"] >= top[2]["prob"]
        attn = torch.tensor(o.trace["attn"])
        assert attn.shape == (4, prompt_len + i)  # heads × context
        torch.testing.assert_close(attn.sum(-1), torch.ones(4))


def _block_bytes(model, block_size: int) -> int:
    from infer.models.kv_cache import PagedKVCache

    return PagedKVCache.bytes_per_block(model.config, block_size, model.dtype)


SYSTEM = "You are a careful assistant. Answer in one short sentence, and never guess. " * 2


def test_prefix_cache_hits_change_nothing(tiny_model, default_tokenizer) -> None:
    prompts = [SYSTEM + q for q in ("What is two plus two?", "Name a colour.", "Hi!")]
    outputs = {}
    for caching in (False, True):
        engine = _engine(tiny_model, default_tokenizer, prefix_caching=caching, block_size=4)
        got = []
        for params in (GREEDY, SEEDED):
            for p in prompts:  # one at a time: each later prompt finds the shared blocks
                req = engine.add_request(p, params)
                got.append(_tokens(_run(engine)[req.request_id]))
        outputs[caching] = got
        assert (engine.blocks.hits > 0) == caching
    assert outputs[True] == outputs[False]


def test_preempted_requests_finish_with_unchanged_output(tiny_model, default_tokenizer) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [_alone(tiny_model, default_tokenizer, p, params) for p in PROMPTS[:4]]
    # 24 blocks of 4 tokens: the four requests cannot all grow to their full length at once.
    engine = _engine(
        tiny_model,
        default_tokenizer,
        block_size=4,
        max_seq_len=96,
        kv_cache_gb=24 * _block_bytes(tiny_model, 4) / 1e9,
        prefix_caching=False,
    )
    reqs = [engine.add_request(p, params) for p in PROMPTS[:4]]
    outs = _run(engine)
    assert engine.scheduler.preemptions > 0
    assert [_tokens(outs[r.request_id]) for r in reqs] == expected
    assert engine.blocks.num_used == 0
