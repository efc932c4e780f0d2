"""The engine worker under trio: one thread, bounded channels, abort, slow readers, shutdown."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from infer.api.errors import ErrorCode
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.params import SamplingParams
from infer.engine.request import Failure, FinishReason, StepOutput, TraceSpec
from infer.server.config import ServerConfig
from infer.server.host.stream import SLOW_CLIENT, RequestStream
from infer.server.host.worker import EngineWorker, QueueFullError, SettlePolicy, WorkerStoppedError

LENGTH = FinishReason.LENGTH
SETTLE = {"policy": SettlePolicy()}


def _worker(model, tokenizer, **kw) -> EngineWorker:
    wkw = {k: kw.pop(k) for k in ("output_buffer", "max_pending_tokens") if k in kw}
    config = EngineConfig(**({"max_batch_size": 4, "max_seq_len": 512} | kw))
    return EngineWorker(
        Engine.from_components(config, model, tokenizer, []), settle=SETTLE["policy"], **wkw
    )


@pytest.fixture(autouse=True, params=["settle-default", "settle-every-step"])
def _settle(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs twice: the engine letting the event loop write a step's outputs first
    only after large steps (the default, which these small batches never reach), and after
    every decode step, so aborts, slow readers and shutdown also meet that wait."""
    if request.param == "settle-every-step":
        monkeypatch.setitem(SETTLE, "policy", SettlePolicy(min_rows=1))


def _params(n: int = 16) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _submit(
    worker: EngineWorker,
    prompt: list[int],
    params: SamplingParams,
    trace: TraceSpec | None = None,
    timeout_s: float | None = None,
) -> RequestStream:
    return worker.submit([prompt], [params], trio.current_time(), trace, timeout_s)


async def _collect(stream: RequestStream) -> list[StepOutput]:
    outs = []
    with stream:
        while not stream.finished:
            item = await stream.next()
            assert item is not None and item[0] == 0
            outs.append(item[1])
    return outs


async def test_streams_complete_with_one_terminal(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer)
    results: dict[int, list[StepOutput]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)

        async def one(i: int) -> None:
            results[i] = await _collect(_submit(worker, [1, 2, 3 + i], _params(8 + i)))

        async with trio.open_nursery() as clients:
            for i in range(6):
                clients.start_soon(one, i)
        nursery.cancel_scope.cancel()
    for i, outs in results.items():
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert outs[-1].outcome is LENGTH
        assert sum(o.token_id is not None for o in outs) == 8 + i


async def test_abort_frees_the_slot(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer, max_batch_size=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        first = _submit(worker, [1, 2, 3], _params(400))
        await first.next()
        first.close()
        first.close()
        second = await _collect(_submit(worker, [4, 5], _params(4)))  # needs first's only slot
        assert second[-1].outcome is LENGTH
        with trio.fail_after(30):
            while worker.waiting or worker.engine.has_work():
                await trio.sleep(0.01)
        assert worker.engine.blocks.num_used == 0
        nursery.cancel_scope.cancel()


async def test_slow_reader_is_coalesced_then_ended(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer, output_buffer=2, max_pending_tokens=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        slow = _submit(worker, [1, 2, 3], _params(60))
        fast = await _collect(_submit(worker, [7, 8], _params(60)))  # never waits on `slow`
        assert fast[-1].outcome is LENGTH
        outs = await _collect(slow)  # read only after it has finished
        assert outs[-1].outcome is LENGTH and len(outs) < 60  # coalesced
        alone = await _collect(_submit(worker, [1, 2, 3], _params(60)))
        assert "".join(o.text_delta for o in outs) == "".join(o.text_delta for o in alone)

        worker.max_pending_tokens = 5  # for streams submitted from now on
        stuck = _submit(
            worker, [1, 2, 3], SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        )
        with trio.fail_after(60):
            while worker.waiting or worker.engine.has_work():
                await trio.sleep(0.01)
        outs = await _collect(stuck)
        assert outs[-1].outcome is Failure.OVERLOADED and outs[-1].message == SLOW_CLIENT
        assert sum(o.finished for o in outs) == 1
        nursery.cancel_scope.cancel()


async def test_queue_full_is_refused_at_once(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer, max_batch_size=1, max_waiting_requests=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        # No checkpoint between the submits: the engine thread cannot take any of them.
        handles = [_submit(worker, [1, 2], _params(4)), _submit(worker, [1, 2], _params(4))]
        with pytest.raises(QueueFullError):
            _submit(worker, [1, 2], _params(4))
        for h in handles:
            assert (await _collect(h))[-1].outcome is LENGTH
        nursery.cancel_scope.cancel()


async def test_timeout_ends_with_length_and_timeout_code(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        outs = await _collect(_submit(worker, [1, 2], _params(500), timeout_s=0.0))
        assert outs[-1].outcome is Failure.TIMEOUT and ErrorCode.TIMEOUT.finish_reason == "length"
        nursery.cancel_scope.cancel()


async def test_shutdown_ends_every_stream(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer)
    handles = []
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        handles = [_submit(worker, [1, 2, 3], _params(500)) for _ in range(3)]
        await handles[0].next()
        nursery.cancel_scope.cancel()
    for h in handles:
        outs = await _collect(h)
        assert outs[-1].outcome is Failure.CANCELLED


async def test_submit_is_refused_once_the_loop_has_stopped(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer)
    with pytest.raises(WorkerStoppedError):
        _submit(worker, [1, 2], _params(4))  # not started yet
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        assert (await _collect(_submit(worker, [1, 2], _params(2))))[-1].outcome is LENGTH
        nursery.cancel_scope.cancel()
    with pytest.raises(WorkerStoppedError):
        _submit(worker, [1, 2], _params(4))
    assert worker._choices == {}


async def test_static_batch_wait_does_not_spin(tiny_model, default_tokenizer) -> None:
    """While a partial static batch waits for more requests, the engine thread sleeps."""
    worker = _worker(
        tiny_model, default_tokenizer, batching_mode="static", batch_wait_timeout_s=0.5
    )
    hops = 0
    exchange = worker._exchange

    def counted(*args: Any) -> Any:
        nonlocal hops
        hops += 1
        return exchange(*args)

    worker._exchange = counted  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        outs = await _collect(_submit(worker, [1, 2, 3], _params(4)))
        nursery.cancel_scope.cancel()
    assert outs[-1].outcome is LENGTH
    # One hop to take the request, one when the batch wait ends, one per step (5): not
    # one per loop turn for half a second.
    assert hops <= 12, hops


async def test_a_slow_reader_keeps_every_logprob_and_trace(tiny_model, default_tokenizer) -> None:
    worker = _worker(tiny_model, default_tokenizer, output_buffer=2, max_pending_tokens=1000)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        slow = _submit(worker, [1, 2, 3], params, TraceSpec(top_k=3))
        await _collect(_submit(worker, [7, 8], _params(40)))  # `slow` finishes meanwhile, unread
        outs = await _collect(slow)
        nursery.cancel_scope.cancel()
    tokens = [o for o in outs if o.token_id is not None]
    assert outs[-1].completion_tokens == 30 == len(tokens)
    assert all(o.logprobs is not None and o.logprobs.top and o.trace for o in tokens)


def test_the_slow_reader_limit_fires_at_default_settings(tiny_model, default_tokenizer) -> None:
    # max_seq_len defaults to the model's context: the tiny model's 2048 is a short one.
    engine = Engine.from_components(EngineConfig(max_batch_size=1), tiny_model, default_tokenizer)
    assert ServerConfig().max_pending_tokens < engine.max_seq_len


async def test_a_request_that_fails_to_queue_ends_alone(
    tiny_model, default_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _worker(tiny_model, default_tokenizer)
    queue = worker.engine.queue

    def failing(ids: list[int], *args: Any) -> Any:
        if ids == [9, 9]:
            raise RuntimeError("simulated")
        return queue(ids, *args)

    monkeypatch.setattr(worker.engine, "queue", failing)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        bad, good = _submit(worker, [9, 9], _params(4)), _submit(worker, [1, 2], _params(4))
        outs = await _collect(bad)
        assert (await _collect(good))[-1].outcome is LENGTH
        nursery.cancel_scope.cancel()
    assert len(outs) == 1 and outs[0].outcome is Failure.INFERENCE_FAILED
    assert worker._choices == {}


async def test_an_event_loop_that_never_idles_does_not_stall_the_engine(
    tiny_model, default_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a decode step the engine waits for the event loop to write its tokens, but only
    for so long: a task that is always runnable must not hold the next step back for good."""
    monkeypatch.setitem(SETTLE, "policy", SettlePolicy(min_rows=1))  # after every step
    worker = _worker(tiny_model, default_tokenizer)

    async def busy() -> None:
        while True:
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        nursery.start_soon(busy)
        with trio.fail_after(60):
            outs = await _collect(_submit(worker, [1, 2, 3], _params(24)))
        nursery.cancel_scope.cancel()
    assert outs[-1].outcome is LENGTH
    assert sum(o.token_id is not None for o in outs) == 24
