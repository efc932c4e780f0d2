"""Speculative decoding: the output is the one a request without drafts gets, token for
token (greedy and seeded), its distribution is the model's (sampled), and a prediction's
use is reported.

On the real Qwen2.5-Coder-0.5B (quantized: its kernel gives each row the same bits whatever
else runs in its step) asked to return a file it is given, so drafts are kept; the
statistical test runs a tiny random model.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.params import SamplingParams
from infer.engine.request import StepOutput
from infer.engine.speculative import DraftState
from infer.models.errors import LoadError
from infer.models.loader import LoadedModel
from support.server import iter_sse, parse_metrics, running_server

QWEN = "qwen2.5-coder-0.5b"
SOURCE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def describe(width, height):
    kind = "square" if width == height else "rectangle"
    return f"{kind} {width}x{height}: area {area(width, height)}"
"""
EDIT = "Add type hints to every function. Return the whole file in one python code block."
PROSE = "Write two sentences about the sea."
SAVE = "Use the write_file tool to save this file as shapes.py."


def _chat(model: LoadedModel, text: str) -> list[int]:
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams, str | None]]) -> list[Any]:
    """Run requests together to the end: each one's outputs."""
    reqs = [engine.add_request(ids, params, prediction=pred) for ids, params, pred in requests]
    outs: dict[str, list[StepOutput]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return [outs[r.request_id] for r in reqs]


def _tokens(outs: list[StepOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def _engine(model: LoadedModel, draft_tokens: int, draft_model: bool = False) -> Engine:
    # Rows priced low: long drafts in every step, the case exactness must hold in.
    config = EngineConfig(
        max_seq_len=1024, max_batch_size=8, draft_tokens=draft_tokens, draft_row_cost=0.02
    )
    drafter = model.model if draft_model else None  # the model drafts for itself
    return Engine(config, model.model, model.tokenizer, model.eos_token_ids, draft_model=drafter)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=72, temperature=0.0),
        SamplingParams(max_new_tokens=72, temperature=0.7, top_p=0.95, seed=3),
    ],
    ids=["greedy", "seeded"],
)
def test_drafts_change_no_token(qwen_model: LoadedModel, params: SamplingParams) -> None:
    """An edit with its file as the prediction, the same edit drafting from its own prompt,
    and prose, in one batch: each gets the tokens it gets alone without drafts."""
    edit = _chat(qwen_model, f"{EDIT}\n\n```python\n{SOURCE}```")
    prose = _chat(qwen_model, PROSE)
    plain = [
        _tokens(_run(_engine(qwen_model, 0), [(ids, params, None)])[0]) for ids in (edit, prose)
    ]
    engine = _engine(qwen_model, 16)
    batch = [(edit, params, SOURCE), (edit, params, None), (prose, params, None)]
    outs = _run(engine, batch)
    assert [_tokens(o) for o in outs] == [plain[0], plain[0], plain[1]]
    spec = engine.scheduler.speculator
    assert spec.accepted >= 20  # the edits copied their file through drafts
    drafted = [sum(o.drafted for o in out) for out in outs]
    assert drafted[0] >= 10 and drafted[1] >= 10
    assert outs[0][-1].accepted_prediction_tokens >= 5
    assert outs[1][-1].accepted_prediction_tokens == 0  # it sent no prediction
    # With a draft model (here the model itself, on a cache of its own, priced as if it
    # cost nothing: a model as large as the target never pays): the prose, which copies
    # nothing, is drafted too, and nothing changes either.
    engine = _engine(qwen_model, 16, draft_model=True)
    engine.scheduler.draft_price = 1.0
    outs = _run(engine, [(prose, params, None), (edit, params, None)])
    assert [_tokens(o) for o in outs] == [plain[1], plain[0]]
    assert sum(o.drafted for o in outs[0]) > 10


def test_a_draft_model_with_another_tokenizer_is_refused_at_start() -> None:
    with pytest.raises(LoadError, match="draft model's tokenizer is not the model's"):
        Engine.from_config(EngineConfig(model="default", draft_model=QWEN))


def test_sampled_drafts_keep_the_model_distribution(
    tiny_model, default_tokenizer, monkeypatch
) -> None:
    """Each request drafts the model's own likeliest two tokens (kept about a third of the
    time at temperature 1); the tokens sampled where a draft was verified follow the
    model's distribution (chi-square over 1,500 fixed seeds)."""
    prompt = default_tokenizer.encode("The quick brown fox")
    params = dict(max_new_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    cache: dict[tuple[int, ...], dict[int, float]] = {}

    def top4(ids: list[int]) -> dict[int, float]:
        """The sampling distribution after ``ids``: the softmax of the top 4 logits."""
        if tuple(ids) not in cache:
            with torch.inference_mode():
                positions = torch.arange(len(ids)).unsqueeze(0)
                logits = tiny_model(torch.tensor([ids]), positions).logits[0, -1].float()
            values, index = torch.topk(logits, 4)
            probs = torch.softmax(values, -1).tolist()
            cache[tuple(ids)] = dict(zip(index.tolist(), probs, strict=True))
        return cache[tuple(ids)]

    def likeliest(ids: list[int]) -> int:
        probs = top4(ids)
        return max(probs, key=probs.__getitem__)

    def draft(self: DraftState, sequence: list[int], k: int) -> list[int]:
        x = likeliest(sequence)
        return [x, likeliest([*sequence, x])][:k]

    monkeypatch.setattr(DraftState, "propose", draft)
    config = EngineConfig(max_seq_len=64, max_batch_size=64, draft_row_cost=1e-6)
    engine = Engine.from_components(config, tiny_model, default_tokenizer, eos_token_ids=[])
    n = 1500
    outs = _run(engine, [(prompt, SamplingParams(seed=i, **params), None) for i in range(n)])
    runs = [_tokens(o) for o in outs]
    spec = engine.scheduler.speculator
    assert spec.drafted >= 2 * n and spec.accepted > n // 4  # drafts verified, many kept
    # Token 2 came from the first row of the draft verified after token 1; token 3, when
    # token 2 kept the draft's first token x, from its second row.
    stat, dof = 0.0, 0
    for t1 in top4(prompt):
        second = [r for r in runs if r[0] == t1]
        stat_2, dof_2 = _chi_square(Counter(r[1] for r in second), top4([*prompt, t1]))
        x = likeliest([*prompt, t1])
        third = [r for r in second if r[1] == x]
        stat_3, dof_3 = _chi_square(Counter(r[2] for r in third), top4([*prompt, t1, x]))
        stat, dof = stat + stat_2 + stat_3, dof + dof_2 + dof_3
    assert dof >= 18
    assert stat < _chi_square_bound(dof), (stat, dof)


def _chi_square(observed: Counter[int], probs: dict[int, float]) -> tuple[float, int]:
    n = sum(observed.values())
    if n < 40:
        return 0.0, 0
    assert set(observed) <= set(probs)  # nothing outside the top 4 is ever drawn
    stat = sum((observed[t] - n * p) ** 2 / (n * p) for t, p in probs.items())
    return stat, len(probs) - 1


def _chi_square_bound(dof: int) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty): a fair sampler fails once
    in 10,000 seeds-sets; a biased one fails with these counts."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


AppFactory = Callable[..., Any]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "functions": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "functions"],
}


def _bodies() -> list[dict[str, Any]]:
    ask = f"{EDIT}\n\n```python\n{SOURCE}```"
    chat = {"model": QWEN, "messages": [{"role": "user", "content": ask}], "temperature": 0}
    predicted = {"prediction": {"type": "content", "content": SOURCE}}
    return [
        chat
        | predicted
        | {"max_tokens": 70, "stop": ["def describe"], "logprobs": True, "top_logprobs": 2},
        chat | predicted | {"max_tokens": 37, "temperature": 0.8, "seed": 11},
        {
            "model": QWEN,
            "messages": [{"role": "user", "content": f"Describe this file as JSON.\n\n{SOURCE}"}],
            "temperature": 0,
            "max_tokens": 80,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "f", "schema": SCHEMA},
            },
        },
        {
            "model": QWEN,
            "messages": [{"role": "user", "content": f"{SAVE}\n\n{SOURCE}"}],
            "tools": TOOLS,
            "temperature": 0,
            "max_tokens": 160,
        },
    ]


async def test_the_server_answers_the_same_with_drafts(qwen_app: AppFactory) -> None:
    """Stop strings, max_tokens, logprobs, a seed, a JSON schema and a tool call: each
    answer is the same with and without speculation; a prediction's use is reported, in
    usage, in /metrics and in the native trace."""
    answers = []
    for draft_tokens in (0, 16):
        async with running_server(qwen_app(engine={"draft_tokens": draft_tokens})) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                replies = [
                    (await client.post("/v1/chat/completions", json=body)).json()
                    for body in _bodies()
                ]
                metrics = (await client.get("/metrics")).text
                native = await _native_trace(client)
        for reply in replies:  # call ids are fresh on every answer
            for call in reply["choices"][0]["message"].get("tool_calls") or []:
                call.pop("id")
        answers.append([r["choices"] for r in replies])
        if draft_tokens:
            usage = replies[0]["usage"]["completion_tokens_details"]
            assert usage["accepted_prediction_tokens"] > 0
            assert "completion_tokens_details" not in replies[2]["usage"]  # no prediction
            drafted = _metric(metrics, "infer_draft_tokens_total")
            accepted = _metric(metrics, "infer_draft_tokens_accepted_total")
            assert drafted >= accepted > 10
            assert 0 < _metric(metrics, "infer_draft_acceptance_rate") <= 1
            assert any(t["drafted"] for t in native)
            assert not all(t["drafted"] for t in native)
    assert answers[1] == answers[0]
    stopped, _, structured, call = answers[0]
    assert stopped[0]["finish_reason"] == "stop" and stopped[0]["logprobs"]["content"]
    json.loads(structured[0]["message"]["content"])
    assert call[0]["message"]["tool_calls"][0]["function"]["name"] == "write_file"


async def _native_trace(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    body = {
        "prompt": f"```python\n{SOURCE}```\nThe same file again:\n```python\n",
        "max_tokens": 40,
        "temperature": 0,
        "trace": {"top_k": 2},
    }
    traces = []
    async with client.stream("POST", "/v1/generate", json=body) as response:
        async for event in iter_sse(response):
            if event.event == "trace":
                traces.append(json.loads(event.data))
    return traces


def _metric(text: str, name: str) -> float:
    values = parse_metrics(text)
    if name not in values:
        raise AssertionError(f"{name} is not in /metrics")
    return values[name]
