"""Several models in one server, the pure parts: the catalog (``--model``, the models file,
keep-alive), which model steps next on the cores, which models stay loaded, metrics per
model, and the embeddings body."""

from __future__ import annotations

import base64
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from infer.api.embeddings.bodies import embedding_list
from infer.api.embeddings.models import EmbeddingRequest
from infer.catalog import model_specs, parse_keep_alive
from infer.engine import residency
from infer.engine.config import EngineConfig
from infer.engine.cores import Cores, Urgency, Waiter, next_holder
from infer.server.host.metrics import Live, Metrics, exposition
from support.server import parse_metrics

LATENCY, THROUGHPUT = Urgency.LATENCY, Urgency.THROUGHPUT


# --- the cores -------------------------------------------------------------------------------


def test_latency_bound_work_goes_first_then_arrival_order() -> None:
    waiting = [Waiter(0, THROUGHPUT), Waiter(1, LATENCY), Waiter(2, THROUGHPUT), Waiter(3, LATENCY)]
    order = []
    while waiting:
        chosen = next_holder(waiting, max_skips=10)
        waiting.remove(chosen)
        order.append(chosen.seq)
    assert order == [1, 3, 0, 2]


def test_a_throughput_waiter_passed_over_max_skips_times_goes_next() -> None:
    """A decode-only model waiting while completions keep arriving is served after
    ``max_skips`` of them went first: nothing starves."""
    decode = Waiter(0, THROUGHPUT)
    waiting, seq, served = [decode], 1, []
    while decode in waiting:
        waiting.append(Waiter(seq, LATENCY))  # a fresh completion step each turn
        seq += 1
        chosen = next_holder(waiting, max_skips=3)
        waiting.remove(chosen)
        served.append(chosen.seq)
    assert served == [1, 2, 3, 0]
    assert next_holder([Waiter(0, THROUGHPUT), Waiter(1, THROUGHPUT)], 1).seq == 0  # FIFO


def _hold_in_thread(cores: Cores, urgency: Urgency, log: list[str], name: str) -> threading.Thread:
    def run() -> None:
        with cores.turn(urgency):
            log.append(name)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll until true (a generous bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.001)


def test_the_cores_are_handed_over_by_urgency_never_shared() -> None:
    """Threads queue while one holds the cores; the release hands them to the latency-bound
    one first, and the releasing thread cannot take them back while others wait."""
    cores = Cores(max_skips=4)
    log: list[str] = []
    cores.acquire(THROUGHPUT)  # the long answer's step runs
    threads = [_hold_in_thread(cores, THROUGHPUT, log, "decode")]
    _wait_until(lambda: cores.waiting == 1)
    threads.append(_hold_in_thread(cores, LATENCY, log, "completion"))
    _wait_until(lambda: cores.waiting == 2)
    cores.release()
    for t in threads:
        t.join(timeout=30)
    assert log == ["completion", "decode"]
    cores.acquire(LATENCY)  # free again: taken at once
    cores.release()


def test_a_latency_bound_thread_keeps_the_cores_until_a_waiter_has_waited_enough() -> None:
    """A completion model keeps the cores between its steps; the long answer waiting for
    them gets them after ``max_skips`` of those steps (keep_s is long: no timing here)."""
    cores = Cores(max_skips=3, keep_s=600)
    log: list[str] = []
    cores.acquire(LATENCY)
    decode = _hold_in_thread(cores, THROUGHPUT, log, "decode")
    _wait_until(lambda: cores.waiting == 1)
    for step in range(3):
        cores.release(keep=True)
        cores.acquire(LATENCY)  # at once: kept for this thread
        log.append(f"completion {step}")
    cores.release(keep=True)  # the decode step has been passed over 3 times: its turn
    decode.join(timeout=30)
    assert log == ["completion 0", "completion 1", "completion 2", "decode"]
    cores.acquire(LATENCY)
    first = _hold_in_thread(cores, LATENCY, log, "first token")  # outranks a keeper
    _wait_until(lambda: cores.waiting == 1)
    cores.release(keep=True)
    first.join(timeout=30)
    assert log[-1] == "first token"


def test_kept_cores_go_on_when_their_keeper_stops() -> None:
    cores = Cores(keep_s=600)
    log: list[str] = []
    cores.acquire(LATENCY)
    cores.release(keep=True)
    waiter = _hold_in_thread(cores, THROUGHPUT, log, "decode")
    _wait_until(lambda: cores.waiting == 1)
    cores.forfeit()  # the keeper's loop ended
    waiter.join(timeout=30)
    quick = Cores(keep_s=0.01)  # a keeper that neither comes back nor forfeits
    quick.acquire(LATENCY)
    quick.release(keep=True)
    late = _hold_in_thread(quick, THROUGHPUT, log, "late")
    late.join(timeout=30)
    assert log == ["decode", "late"]


# --- which models stay loaded ------------------------------------------------------------------


@dataclass
class Model:
    name: str
    size: int
    last_used: float
    loaded: bool = True
    busy: bool = False
    pinned: bool = False
    expires_at: float = math.inf


def test_room_is_made_from_the_least_recently_used_idle_unpinned_models() -> None:
    models = [
        Model("pinned", 4, last_used=0, pinned=True),
        Model("busy", 4, last_used=1, busy=True),
        Model("old", 2, last_used=2),
        Model("newer", 2, last_used=3),
        Model("newest", 2, last_used=4),
        Model("unloaded", 9, last_used=-1, loaded=False),
    ]
    assert residency.to_evict(models, need=2, budget=16) == []  # 14 used: it fits
    assert [m.name for m in residency.to_evict(models, 3, 16) or []] == ["old"]
    assert [m.name for m in residency.to_evict(models, 5, 16) or []] == ["old", "newer"]
    assert residency.to_evict(models, 11, 16) is None  # pinned and busy hold 8 of 16


def test_keep_alive_unloads_idle_models_on_a_fake_clock() -> None:
    models = [
        Model("a", 1, 0, expires_at=10.0),
        Model("b", 1, 0, expires_at=5.0),
        Model("busy", 1, 0, busy=True, expires_at=1.0),
        Model("pinned", 1, 0, pinned=True, expires_at=1.0),
        Model("forever", 1, 0),
    ]
    assert residency.next_expiry(models) == 5.0
    assert residency.expired(models, now=4.9) == []
    assert [m.name for m in residency.expired(models, now=5.0)] == ["b"]
    assert [m.name for m in residency.expired(models, now=99)] == ["a", "b"]
    assert residency.next_expiry(models[2:]) == math.inf


# --- the catalog -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        ("5m", 300),
        ("1h30m", 5400),
        ("500ms", 0.5),
        ("2μs", 2e-6),  # Go takes either micro sign
        ("0", 0),
        (0, 0),
        (90, 90),
        ("-1", math.inf),
    ],
)
def test_keep_alive_takes_ollamas_durations(given: str | int, seconds: float) -> None:
    assert parse_keep_alive(given) == seconds
    assert parse_keep_alive("-5m") == math.inf


@pytest.mark.parametrize("bad", ["soon", "5 m", "m", "", "nan", True])
def test_keep_alive_refuses_what_is_not_a_duration(bad: str | bool) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(bad)


def test_one_plain_model_flag_serves_as_before() -> None:
    engine = EngineConfig(max_batch_size=8)
    [spec] = model_specs(["qwen2.5-coder-0.5b"], "", engine, ("coder",))
    assert (spec.name, spec.source, spec.names, spec.engine.max_batch_size) == (
        None,
        "qwen2.5-coder-0.5b",
        ("coder",),
        8,
    )
    [spec] = model_specs([], "", EngineConfig(model="default"))
    assert spec.source == "default" and spec.names == ()


def test_several_model_flags_name_their_models_the_first_is_the_default() -> None:
    specs = model_specs(["chat=default", "./models/minilm", "org/e5"], "", EngineConfig(), ["c"])
    assert [(s.name, s.source) for s in specs] == [
        ("chat", "default"),
        ("minilm", "./models/minilm"),
        ("e5", "org/e5"),
    ]
    assert specs[0].aliases == ("c",)
    with pytest.raises(ValueError, match="given twice"):
        model_specs(["a=default", "a=qwen2.5-coder-0.5b"], "", EngineConfig())


def test_a_models_file_gives_each_model_its_settings(tmp_path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        'default = "chat"\n'
        "[models.complete]\n"
        'source = "qwen2.5-coder-0.5b"\n'
        "pinned = true\n"
        "max_seq_len = 4096\n"
        "[models.chat]\n"
        'source = "qwen2.5-coder-1.5b"\n'
        'aliases = ["gpt-4o-mini"]\n'
        'keep_alive = "30m"\n'
        "kv_cache_gb = 1\n"
        'draft_model = "qwen2.5-coder-0.5b"\n'
    )
    specs = model_specs(["embed=all-minilm-l6-v2"], str(path), EngineConfig())
    assert [s.name for s in specs] == ["chat", "embed", "complete"]
    chat, complete = specs[0], specs[2]
    assert chat.names == ("chat", "gpt-4o-mini") and chat.keep_alive_s == 1800
    assert (chat.engine.kv_cache_gb, chat.engine.draft_model) == (1, "qwen2.5-coder-0.5b")
    assert complete.pinned and complete.engine.max_seq_len == 4096
    assert complete.keep_alive_s is None and specs[1].engine.max_seq_len is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[models.a]\nsource = "default"\ncolour = 1\n', "unknown keys \\['colour'\\]"),
        ('[models.a]\nsource = "default"\nmax_seq_len = "long"\n', "max_seq_len must be int"),
        ('[models.a]\nsource = "default"\npinned = "yes"\n', "pinned must be true or false"),
        ("[models.a]\nmax_seq_len = 8\n", "needs source"),
        ('default = "b"\n[models.a]\nsource = "default"\n', "default 'b' is not one"),
        ('[models.a]\nsource = "default"\nbatching_mode = "eager"\n', "batching_mode must be"),
        ("[models.a\n", "cannot read the models file"),
    ],
)
def test_a_bad_models_file_is_named_with_its_model(tmp_path, text: str, error: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        model_specs([], str(path), EngineConfig())


# --- metrics per model, embeddings body ---------------------------------------------------------


def test_metrics_write_each_family_once_with_a_series_per_model() -> None:
    chat, embed = Metrics(), Metrics()
    chat.finished["length"] += 2
    chat.ttft.observe(0.2)
    embed.prompt_tokens += 7
    text = exposition([("chat", chat, Live(1, 2, True)), ("embed", embed, Live(0, 0, True))])
    assert text.count("# TYPE infer_requests_running gauge") == 1
    assert 'infer_requests_running{model="chat"} 1.0' in text.splitlines()
    assert parse_metrics(text, "chat")['infer_requests_total{finish_reason="length"}'] == 2
    assert parse_metrics(text, "embed")["infer_prompt_tokens_total"] == 7
    both = parse_metrics(text)
    assert both["infer_requests_waiting"] == 2 and both["infer_ready"] == 2
    assert both["infer_time_to_first_token_seconds_count"] == 1


def test_an_embeddings_body_takes_texts_or_token_ids() -> None:
    assert EmbeddingRequest(input="a").inputs() == ["a"]
    assert EmbeddingRequest(input=["a", "b"]).inputs() == ["a", "b"]
    assert EmbeddingRequest(input=[1, 2]).inputs() == [[1, 2]]
    assert EmbeddingRequest(input=[[1], [2, 3]]).inputs() == [[1], [2, 3]]
    for bad in ([], [[]], [1, "a"], [-1], 3, {"text": "a"}):
        with pytest.raises(ValueError):
            EmbeddingRequest(input=bad)


def test_base64_embeddings_are_little_endian_float32() -> None:
    vectors = torch.tensor([[0.5, -1.25, 3.0e-8]])
    [item] = embedding_list("m", vectors, 3, "base64")["data"]
    assert isinstance(item["embedding"], str)
    decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert decoded.tolist() == vectors[0].tolist()
    floats = embedding_list("m", vectors, 3, "float")
    assert floats["data"][0]["embedding"] == vectors[0].tolist()
    assert floats["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
