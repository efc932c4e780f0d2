"""Scheduler policies on plain Request objects (no model)."""

from __future__ import annotations

import time

import pytest

from infer.engine.config import EngineConfig
from infer.engine.request import FinishReason, Request, RequestStatus
from infer.engine.sampler import SamplingParams
from infer.engine.scheduler import ContinuousScheduler, StaticScheduler, make_scheduler


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


def _static(**kw) -> StaticScheduler:
    return StaticScheduler(EngineConfig(**({"batching_mode": "static"} | kw)))


def test_static_forms_a_batch_in_fcfs_order() -> None:
    s = _static(max_batch_size=4, batch_wait_timeout_s=0.0)
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, b, c):
        assert s.add_request(r)
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
    s = _static(max_batch_size=4, batch_wait_timeout_s=0.01)
    s.add_request(_req("a"))
    s.add_request(_req("b"))
    assert s.schedule().is_empty  # the timer started
    time.sleep(0.02)
    plan = s.schedule()
    assert len(plan.prefill) == 2
    _retire(s, *(c.request for c in plan.prefill))
    s.add_request(_req("c"))  # a new batch starts a fresh timer
    assert s.schedule().is_empty


def test_queue_overflow_is_refused() -> None:
    for mode in ("static", "continuous"):
        s = make_scheduler(EngineConfig(batching_mode=mode, max_waiting_requests=2))
        assert s.add_request(_req("a")) and s.add_request(_req("b"))
        assert not s.add_request(_req("c"))


def test_continuous_admits_into_free_slots_every_step() -> None:
    s = ContinuousScheduler(EngineConfig(max_batch_size=2))
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
    s = ContinuousScheduler(EngineConfig(max_batch_size=4, prefill_token_budget=16))
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


def test_prefill_batch_respects_padded_budget() -> None:
    s = ContinuousScheduler(EngineConfig(max_batch_size=8, prefill_token_budget=32))
    reqs = [_req(str(i), n) for i, n in enumerate([8, 5, 8, 30, 2])]
    for r in reqs:
        s.add_request(r)
    plan = s.schedule()
    # The first prompt sets the width (8); four rows of 8 fit the budget of 32.
    assert [(c.request.request_id, c.length) for c in plan.prefill] == [
        ("0", 8), ("1", 5), ("2", 8), ("3", 8)
    ]


def test_has_work() -> None:
    s = ContinuousScheduler(EngineConfig())
    assert not s.has_work()
    r = _req("a")
    s.add_request(r)
    assert s.has_work()
    s.schedule()
    _retire(s, r)
    assert not s.has_work()


@pytest.mark.parametrize("field,value", [
    ("max_batch_size", 0), ("batching_mode", "dynamic"), ("dtype", "int8"),
    ("prefill_token_budget", 0), ("batch_wait_timeout_s", -1.0),
])
def test_invalid_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
