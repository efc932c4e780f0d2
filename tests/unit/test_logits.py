"""The logits step: OpenAI's presence/frequency penalties, logit bias and grammar masks."""

from __future__ import annotations

import json

import pytest
import torch

from infer.engine.grammar import GrammarCompiler
from infer.engine.logit_processors import output_counts, process_logits
from infer.engine.params import SamplingParams
from infer.engine.request import Request
from infer.engine.sampler import sample


def _req(output_ids: list[int] = (), **params) -> Request:  # type: ignore[assignment]
    req = Request("r", [1, 2, 3], SamplingParams(**params))
    req.output_ids = list(output_ids)
    return req


def test_untouched_when_no_request_uses_it() -> None:
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    reqs = [_req(), _req(repetition_penalty=1.3), _req(temperature=0.0)]
    assert process_logits(logits, reqs) is logits


def test_logit_bias_adds_to_its_row_only_and_keeps_the_input() -> None:
    logits = torch.zeros(2, 10)
    out = process_logits(logits, [_req(logit_bias={3: 5.0, 7: -100.0}), _req()])
    expected = torch.zeros(2, 10)
    expected[0, 3], expected[0, 7] = 5.0, -100.0
    assert torch.equal(out, expected) and torch.equal(logits, torch.zeros(2, 10))


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.full((3, 6), 1.0)
    reqs = [
        _req([2, 2, 2, 4], presence_penalty=0.5, frequency_penalty=0.25),
        _req([2, 2], presence_penalty=-1.0),  # negative: encourages repeats
        _req([2], frequency_penalty=0.0),
    ]
    out = process_logits(logits, reqs)
    # row 0: token 2 seen 3x -> 1 - (3 * 0.25 + 0.5); token 4 once -> 1 - (0.25 + 0.5)
    assert out[0].tolist() == [1.0, 1.0, -0.25, 1.0, 0.25, 1.0]
    assert out[1].tolist() == [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]
    assert out[2].tolist() == [1.0] * 6


def test_prompt_tokens_are_not_penalized() -> None:
    req = _req([], presence_penalty=2.0)  # prompt is [1, 2, 3], nothing generated yet
    assert process_logits(torch.zeros(1, 5), [req]).tolist() == [[0.0] * 5]


def test_output_counts_ignores_ids_past_the_vocabulary() -> None:
    counts = output_counts([[0, 0, 9], [1]], 4, torch.device("cpu"))
    assert counts.tolist() == [[2, 0, 0, 0], [0, 1, 0, 0]]


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.checked(**{field: value})


def test_banned_token_never_sampled_forced_token_always() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 100) * 3
    favourite = logits.argmax(dim=-1)
    banned = [_req(logit_bias={int(t): -100.0}, temperature=1.0) for t in favourite]
    tokens = sample(
        process_logits(logits, banned), [r.params for r in banned], [None] * 64, [()] * 64
    )
    assert all(t != int(f) for t, f in zip(tokens, favourite, strict=True))
    forced = [_req(logit_bias={42: 100.0}, temperature=1.0) for _ in range(64)]
    tokens = sample(
        process_logits(logits, forced), [r.params for r in forced], [None] * 64, [()] * 64
    )
    assert tokens == [42] * 64


def test_grammar_rows_are_masked_and_others_untouched(default_tokenizer) -> None:
    torch.manual_seed(1)
    vocab = 49152
    compiler = GrammarCompiler(default_tokenizer, vocab, [default_tokenizer.eos_token_id])
    grammar = compiler.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    constrained, free = _req(grammar=grammar), _req(logit_bias={5: 1.0})
    logits = torch.randn(2, vocab)
    out = process_logits(logits, [constrained, free])
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and all(default_tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    expected_free = logits[1].clone()
    expected_free[5] += 1.0
    assert torch.equal(out[1], expected_free)
    # Greedy through the mask until the grammar only allows EOS: valid JSON.
    for _ in range(200):
        token = int(process_logits(torch.randn(1, vocab), [constrained]).argmax())
        if token == default_tokenizer.eos_token_id:
            break
        constrained.output_ids.append(token)
    text = default_tokenizer.decode(constrained.output_ids)
    assert isinstance(json.loads(text)["a"], int)
