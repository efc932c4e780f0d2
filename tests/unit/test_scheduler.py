"""Scheduler policies on plain Request objects (no model)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig
from infer.engine.params import SamplingParams
from infer.engine.request import FinishReason, Request, RequestStatus
from infer.engine.scheduler import ContinuousScheduler, StaticScheduler


def _req(name: str, prompt_len: int = 4) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=8))


def _finish(*reqs: Request) -> None:
    for r in reqs:
        r.finish(RequestStatus.FINISHED, FinishReason.LENGTH)


def _retire(sched, *reqs: Request) -> None:
    _finish(*reqs)
    for r in reqs:
        sched.remove(r)


def _prefill_all(plan) -> None:
    """Pretend the runner prefilled every chunk and sampled first tokens."""
    for c in plan.prefill:
        c.request.num_cached += c.length
        if c.completes_prompt:
            c.request.status = RequestStatus.DECODE


def _static(clock: Any = time.monotonic, **kw: Any) -> StaticScheduler:
    config = EngineConfig(**({"batching_mode": "static", "max_seq_len": 2048} | kw))
    return StaticScheduler(config, clock=clock)


def test_static_forms_a_batch_in_fcfs_order() -> None:
    s = _static(max_batch_size=4, batch_wait_timeout_s=0.0)
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, b, c):
        s.add_request(r)
    plan = s.schedule()
    assert [ch.request for ch in plan.prefill] == [a, b, c]
    assert all(r.status == RequestStatus.PREFILL for r in (a, b, c))
    _prefill_all(plan)
    assert s.schedule().decode == [a, b, c]  # the batch is still active


def test_static_runs_batch_to_completion_before_admitting() -> None:
    s = _static(max_batch_size=2, batch_wait_timeout_s=0.0)
    reqs = [_req(str(i)) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    sizes = []
    while s.has_work():
        plan = s.schedule()
        _prefill_all(plan)
        batch = [c.request for c in plan.prefill]
        sizes.append(len(batch))
        _retire(s, batch[0])  # partial completion: the other keeps the batch alive
        assert s.schedule().prefill == []  # nothing admitted while one is still running
        _retire(s, *batch[1:])
    assert sizes == [2, 2, 1]
    assert not s.has_work()


def test_static_dispatches_at_once_when_full() -> None:
    s = _static(max_batch_size=4, batch_wait_timeout_s=10.0)
    for i in range(4):
        s.add_request(_req(str(i)))
    assert len(s.schedule().prefill) == 4


def test_static_waits_for_the_batch_to_fill_then_times_out() -> None:
    now = [100.0]
    s = _static(max_batch_size=4, batch_wait_timeout_s=0.01, clock=lambda: now[0])
    s.add_request(_req("a"))
    s.add_request(_req("b"))
    assert s.schedule().is_empty  # the timer started
    now[0] += 0.005
    assert s.schedule().is_empty  # not yet
    now[0] += 0.01
    plan = s.schedule()
    assert len(plan.prefill) == 2
    _retire(s, *(c.request for c in plan.prefill))
    s.add_request(_req("c"))  # a new batch starts a fresh timer
    assert s.schedule().is_empty


def test_continuous_admits_into_free_slots_every_step() -> None:
    s = ContinuousScheduler(EngineConfig(max_batch_size=2, max_seq_len=2048))
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, b, c):
        s.add_request(r)
    plan = s.schedule()
    assert [ch.request for ch in plan.prefill] == [a, b]
    _prefill_all(plan)
    _retire(s, a)
    plan = s.schedule()
    assert plan.decode == [b] and [ch.request for ch in plan.prefill] == [c]


def test_long_prompt_is_chunked_and_decode_keeps_flowing() -> None:
    s = ContinuousScheduler(
        EngineConfig(max_batch_size=4, max_seq_len=2048, prefill_token_budget=16)
    )
    short, long = _req("short", 3), _req("long", 40)
    s.add_request(short)
    _prefill_all(s.schedule())
    s.add_request(long)
    starts = []
    while long.status != RequestStatus.DECODE:
        plan = s.schedule()
        assert plan.decode[:1] == [short]  # the running stream decodes every step
        assert sum(c.length for c in plan.prefill) <= 16
        starts += [c.start for c in plan.prefill]
        _prefill_all(plan)
    assert starts == [0, 16, 32]


def test_prefill_packs_prompts_into_the_token_budget() -> None:
    s = ContinuousScheduler(
        EngineConfig(max_batch_size=8, max_seq_len=2048, prefill_token_budget=32)
    )
    reqs = [_req(str(i), n) for i, n in enumerate([8, 5, 8, 30, 2])]
    for r in reqs:
        s.add_request(r)
    plan = s.schedule()
    # No padding: 8 + 5 + 8 + the first 11 of 30 fill the 32 tokens; "4" waits its turn.
    assert [(c.request.request_id, c.length) for c in plan.prefill] == [
        ("0", 8),
        ("1", 5),
        ("2", 8),
        ("3", 11),
    ]
    _prefill_all(plan)
    plan = s.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefill] == [
        ("3", 11, 19),
        ("4", 0, 2),
    ]


def _blocks(n: int, prefix_caching: bool = False) -> BlockManager:
    return BlockManager(n, 4, prefix_caching)


def test_a_request_waits_until_blocks_are_free() -> None:
    blocks = _blocks(4)  # 16 tokens
    s = ContinuousScheduler(EngineConfig(max_batch_size=4, max_seq_len=16), blocks)
    a, b = _req("a", 12), _req("b", 8)
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    assert [c.request for c in plan.prefill] == [a] and list(s.waiting) == [b]
    _prefill_all(plan)
    _retire(s, a)
    assert blocks.num_used == 0
    assert [c.request for c in s.schedule().prefill] == [b]


def test_decode_without_a_free_block_preempts_the_newest_request() -> None:
    blocks = _blocks(4)
    s = ContinuousScheduler(EngineConfig(max_batch_size=4, max_seq_len=16), blocks)
    a, b = _req("a", 8), _req("b", 8)  # two blocks each: the pool is full
    for r in (a, b):
        s.add_request(r)
    _prefill_all(s.schedule())
    for r in (a, b):
        r.output_ids.append(1)
    plan = s.schedule()  # both need a third block for position 8; only a can have it
    assert plan.decode == [a] and s.running == [a] and list(s.waiting) == [b]
    assert b.status == RequestStatus.WAITING and b.num_cached == 0 and s.preemptions == 1
    _retire(s, a)
    plan = s.schedule()  # b recomputes its prompt and the token it had generated
    assert [(c.request, c.start, c.length) for c in plan.prefill] == [(b, 0, 9)]


def test_prompts_stuck_part_way_through_prefill_make_room_for_the_oldest() -> None:
    blocks = _blocks(4)  # 16 tokens
    s = ContinuousScheduler(EngineConfig(max_batch_size=4, max_seq_len=16), blocks)
    a, b = _req("a", 12), _req("b", 12)
    for r in (a, b):  # each prefilled 8 of its 12 tokens: the pool is full, nobody decodes
        s.waiting.append(r)
        assert s._start(s.waiting.popleft(), 8)
        r.num_cached = 8
    assert blocks.num_free == 0
    plan = s.schedule()
    assert [(c.request, c.start, c.length) for c in plan.prefill] == [(a, 8, 4)]
    assert list(s.waiting) == [b] and s.preemptions == 1


def test_prefix_cache_hands_full_blocks_to_a_later_prompt() -> None:
    blocks = _blocks(16, prefix_caching=True)
    s = ContinuousScheduler(EngineConfig(max_batch_size=4, max_seq_len=64), blocks)
    first = _req("first", 10)  # two full blocks of 4, then 2 tokens
    s.add_request(first)
    plan = s.schedule()
    for c in plan.prefill:  # as the runner does after its forward
        c.request.num_cached += c.length
        blocks.commit(c.request.request_id, c.request.token_ids, c.request.num_cached)
    shared = blocks.table("first")[:2]
    _retire(s, first)
    again = Request("again", list(range(1, 9)) + [77, 78, 79], SamplingParams())
    s.add_request(again)
    plan = s.schedule()
    assert [(c.start, c.length) for c in plan.prefill] == [(8, 3)]
    assert blocks.table("again")[:2] == shared and blocks.hits == 2


def test_a_prompt_being_scored_recomputes_what_it_has_not_scored() -> None:
    """The prefix cache serves a later prompt its cached blocks (counted in its
    ``cached_tokens``), but not a prompt whose positions still need scoring."""
    blocks = _blocks(16, prefix_caching=True)
    s = ContinuousScheduler(EngineConfig(max_batch_size=4, max_seq_len=64), blocks)
    first = _req("first", 10)
    s.add_request(first)
    for c in s.schedule().prefill:
        c.request.num_cached += c.length
        blocks.commit(c.request.request_id, c.request.token_ids, c.request.num_cached)
    _retire(s, first)
    scored = Request("scored", list(range(1, 11)), SamplingParams(prompt_logprobs=1))
    plain = Request("plain", list(range(1, 11)), SamplingParams())
    s.add_request(scored)
    s.add_request(plain)
    plan = s.schedule()
    assert [(c.request, c.start, c.length) for c in plan.prefill] == [
        (scored, 0, 10),
        (plain, 8, 2),
    ]
    assert (first.cached_tokens, scored.cached_tokens, plain.cached_tokens) == (0, 0, 8)


def test_has_work() -> None:
    s = ContinuousScheduler(EngineConfig(max_seq_len=2048))
    assert not s.has_work()
    r = _req("a")
    s.add_request(r)
    assert s.has_work()
    s.schedule()
    _retire(s, r)
    assert not s.has_work()


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_batch_size", 0),
        ("max_seq_len", 0),
        ("batching_mode", "dynamic"),
        ("dtype", "int8"),
        ("prefill_token_budget", 0),
        ("batch_wait_timeout_s", -1.0),
        ("block_size", 3),
    ],
)
def test_invalid_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
