"""The benchmark's pure parts: SSE parsing, stream accounting, metrics, workloads, report."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable

import httpx
import pytest
import trio
from transformers import PreTrainedTokenizerBase

from infer import cli
from infer.bench.bandwidth import STEADY_SPREAD, add_shares
from infer.bench.client import Target, _StreamState, run_workload
from infer.bench.main import _variant_of, _with_variants, add_ratios
from infer.bench.metrics import RequestResult, distribution_ms, summarize
from infer.bench.report import bandwidth_table, markdown
from infer.bench.sse import SSEEvent, SSEParser
from infer.bench.systems import (
    INFER_SERVERS,
    Settings,
    llama_variants,
    parse_draft_counters,
    reads_gguf,
)
from infer.bench.workloads import (
    AGENT_TOOLS,
    EDIT_LINES,
    EDIT_MODULES,
    SCALE_SIZES,
    SOURCE_TEXT,
    WORKLOAD_NAMES,
    BenchRequest,
    PromptSource,
    Workload,
    build_workloads,
    defined_names,
    edit_sources,
)

# A report's metadata, as the bench writes it (the fields the report text reads).
META = {
    "date": "2025-01-01T00:00:00",
    "host": "h",
    "model": "m",
    "dtype": "bfloat16",
    "cpu": "c",
    "cpu_count": 2,
    "torch": "t",
    "torch_threads": 2,
    "scale": "smoke",
    "seed": 0,
    "load_average": [0.0],
    "command": "infer bench",
    "notes": [],
}


def _feed_all(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


STREAM = (
    b'event: started\ndata: {"id": "r1"}\n\n'
    b": heartbeat\n\n"
    b'event: token\ndata: {"i": 0, "token": "caf\\u00e9 \\u2603"}\n\n'
    b'event: done\ndata: {"finish_reason": "length",\n'
    b'data:  "usage": {"completion_tokens": 1}}\n\n'
)


def test_sse_events_whole_stream() -> None:
    events = _feed_all([STREAM])
    assert [e.event for e in events] == ["started", "token", "done"]
    assert json.loads(events[1].data)["token"] == "café ☃"
    # data lines join with a newline; one leading space after the colon is dropped
    assert events[2].data == '{"finish_reason": "length",\n "usage": {"completion_tokens": 1}}'


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_sse_events_do_not_depend_on_chunking(size: int) -> None:
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert _feed_all(chunks) == _feed_all([STREAM])


def test_sse_crlf_cr_comments_and_unnamed_events() -> None:
    raw = b": ping\r\n\r\ndata: a\r\ndata: b\r\rid: 7\revent: x\rdata: c\r\n\r\n"
    for chunks in ([raw], [raw[i : i + 1] for i in range(len(raw))]):
        parser = SSEParser()
        events = [e for c in chunks for e in parser.feed(c)]
        assert events == [SSEEvent("message", "a\nb"), SSEEvent("x", "c", "7")]
        assert parser.comments == 1


def test_sse_split_utf8_and_dataless_event() -> None:
    raw = "event: token\ndata: ☃\n\nevent: empty\n\n".encode()
    cut = raw.index("☃".encode()) + 1  # inside the three-byte character
    assert _feed_all([raw[:cut], raw[cut:]]) == [SSEEvent("token", "☃")]


def test_native_stream_state_counts_tokens_and_usage() -> None:
    result = RequestResult(start=0.0)
    state = _StreamState("native", result)
    for t, event in enumerate(_feed_all([STREAM])):
        state.on_event(event, float(t + 1))
    assert state.finished and result.ok
    assert result.token_times == [2.0] and result.output_tokens == 1 and result.end == 3.0


def test_native_error_event_is_an_error() -> None:
    result = RequestResult(start=0.0)
    state = _StreamState("native", result)
    state.on_event(SSEEvent("error", '{"code": "OVERLOADED", "message": "full"}'), 1.0)
    assert state.finished and not result.ok and result.error == "OVERLOADED"


def test_openai_stream_state() -> None:
    result = RequestResult(start=0.0)
    state = _StreamState("openai", result)
    chunks = [
        '{"choices": [{"text": "Hi"}]}',
        '{"choices": [{"text": ""}]}',
        '{"choices": [{"text": "!", "finish_reason": "length"}]}',
        "[DONE]",
    ]
    for t, data in enumerate(chunks):
        state.on_event(SSEEvent("message", data), float(t + 1))
    assert result.token_times == [1.0, 3.0] and result.output_tokens == 2 and result.end == 4.0


def test_target_body() -> None:
    request = BenchRequest((1, 2, 3), 5)
    body = Target("http://h", "native", {"ignore_eos": True}).body(request)
    assert body == {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    assert Target("http://h", "openai").body(request)["stream"] is True


def test_prediction_is_sent_only_by_a_target_that_sends_them() -> None:
    edit = BenchRequest((1, 2), 5, prediction="def f():\n    pass\n")
    for api in ("native", "openai"):
        sent = Target("http://h", api, predictions=True).body(edit)
        assert sent["prediction"] == {"type": "content", "content": "def f():\n    pass\n"}
        assert sent["prompt"] == [1, 2]  # token ids either way
        assert "prediction" not in Target("http://h", api).body(edit)
    assert "prediction" not in Target("http://h", predictions=True).body(BenchRequest((1,), 2))


def test_request_metrics() -> None:
    r = RequestResult(start=10.0, token_times=[10.5, 10.6, 10.8], end=10.9, output_tokens=3)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert r.tpot == pytest.approx(0.15)
    assert r.e2e == pytest.approx(0.9)


def test_summarize_counts_errors_and_throughput() -> None:
    ok = RequestResult(0.0, [0.1, 0.2, 0.3], 0.4, output_tokens=3, expected_tokens=4)
    failed = RequestResult(0.0, [], 2.0, error="HTTP_503")
    s = summarize([ok, failed])
    assert (s["requests"], s["completed"], s["errors"], s["short"]) == (2, 1, 1, 1)
    assert s["error_codes"] == {"HTTP_503": 1}
    assert s["wall_s"] == 2.0 and s["output_tok_s"] == 1.5 and s["req_s"] == 0.5
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(400.0)


def test_distribution_percentiles_are_ordered_and_empty_is_none() -> None:
    d = distribution_ms([0.001 * i for i in range(1, 101)])
    assert d["p50"] <= d["p95"] <= d["p99"] and d["mean"] == pytest.approx(50.5)
    assert distribution_ms([]) == {"p50": None, "p95": None, "p99": None, "mean": None}


class _ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def test_prompts_have_exact_lengths_and_are_reproducible() -> None:
    tok = _ByteTokenizer()
    a = build_workloads(tok, ["w1", "w2", "sweep"], "full", seed=3)
    b = build_workloads(tok, ["w1", "w2", "sweep"], "full", seed=3)
    assert a == b
    w1, w2, *sweep = a
    assert len(w1.requests[0].prompt_ids) == 256 and w1.requests[0].max_new_tokens == 256
    assert len(w2.requests) == 16 and w2.concurrency == 16
    assert all(32 <= len(r.prompt_ids) <= 1024 for r in w2.requests)
    assert all(64 <= r.max_new_tokens <= 256 for r in w2.requests)
    assert [w.concurrency for w in sweep] == [1, 4, 16, 64]
    # the same lengths at every level, fresh text at each (a prefix cache cannot replay them)
    assert len({_lengths(w) for w in sweep}) == 1
    assert len({w.requests for w in sweep}) == len(sweep)
    assert build_workloads(tok, ["w2"], "full", seed=4)[0].requests != w2.requests


def _lengths(w: Workload) -> tuple[tuple[int, int], ...]:
    return tuple((len(r.prompt_ids), r.max_new_tokens) for r in w.requests)


class _WordTokenizer:
    """One id per word with the whitespace before it (as BPE tokenizers split text)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = re.findall(r"\s*\S+", text)
        return [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]

    def decode(self, ids: tuple[int, ...]) -> str:
        pieces = {i: p for p, i in self.vocab.items()}
        return "".join(pieces[i] for i in ids)


def _by_name(workloads: list[Workload]) -> dict[str, Workload]:
    return {w.name: w for w in workloads}


def test_new_workloads_sizes_at_full_scale() -> None:
    tok = _WordTokenizer()
    w = _by_name(build_workloads(tok, ["w2", "w2serial", "chat64", "prefix"], "full", seed=1))
    chat, serial, prefix = w["chat64"], w["W2-serial"], w["prefix"]
    assert len(chat.requests) == chat.concurrency == 64
    assert all(r.max_new_tokens == 128 for r in chat.requests)
    # the word tokenizer has one token per word: 20-50 words is 20-50 tokens
    assert all(20 <= len(r.prompt_ids) <= 50 for r in chat.requests)
    assert serial.concurrency == 1 and _lengths(serial) == _lengths(w["W2"])
    assert serial.requests != w["W2"].requests  # same lengths, fresh text
    assert len(prefix.requests) == 16 and all(r.max_new_tokens == 32 for r in prefix.requests)
    assert prefix.concurrency in (1, 4)


def test_chat_prompts_are_whole_words_of_the_text() -> None:
    tok = _ByteTokenizer()
    (chat,) = build_workloads(tok, ["chat64"], "full", seed=2)
    for r in chat.requests:
        text = bytes(r.prompt_ids).decode()
        words = text.split()
        assert 20 <= len(words) <= 50 and text == " ".join(words)
        assert text in " ".join(SOURCE_TEXT.split() * 2)  # consecutive words, maybe wrapped


def test_prefix_workload_really_shares_its_prefix() -> None:
    tok = _WordTokenizer()
    for scale in ("full", "quick", "smoke"):
        (prefix,) = build_workloads(tok, ["prefix"], scale, seed=5)
        n = SCALE_SIZES[scale].prefix_len
        heads = {r.prompt_ids[:n] for r in prefix.requests}
        assert len(heads) == 1 and len(next(iter(heads))) == n  # exactly n tokens, all shared
        tails = [r.prompt_ids[n:] for r in prefix.requests]
        assert all(tails) and len(set(tails)) == len(tails)  # a different question each
        assert len(prefix.requests) == SCALE_SIZES[scale].prefix_requests


def test_no_two_prompts_share_a_start_outside_the_prefix_workload() -> None:
    # A first KV block (16 tokens in infer) shared by two prompts would be a prefix-cache hit.
    # (The text repeats itself for up to 12 words: "there were a king with a large jaw ...".)
    # The exceptions: the prefix load, an agent's later turns, and prose (W1 again).
    tok = _WordTokenizer()
    workloads = build_workloads(tok, list(WORKLOAD_NAMES), "full", seed=0)
    heads = [
        r.prompt_ids[:16]
        for w in workloads
        if w.name not in ("prefix", "prose")
        for r in w.requests
        if r.label not in w.follow_ups
    ]
    assert len(heads) == len(set(heads))
    warm_up = tuple(tok.encode(SOURCE_TEXT[:200]))[:16]
    assert warm_up not in heads


def test_a_workload_is_the_same_whichever_others_run() -> None:
    tok = _ByteTokenizer()
    every = _by_name(build_workloads(tok, list(WORKLOAD_NAMES), "quick", seed=3))
    for name in ("w2", "chat64", "prefix", "edit", "agent", "prose", "long"):
        (alone,) = build_workloads(tok, [name], "quick", seed=3)
        assert alone == every[alone.name]
    with pytest.raises(ValueError, match="unknown workloads"):
        build_workloads(tok, ["w3"], "quick")


def test_coding_agent_loads_are_reproducible_per_seed() -> None:
    names = ["edit", "agent", "prose"]
    a = build_workloads(_WordTokenizer(), names, "full", seed=3)
    assert a == build_workloads(_WordTokenizer(), names, "full", seed=3)
    b = build_workloads(_WordTokenizer(), names, "full", seed=4)
    for x, y in zip(a[:2], b[:2], strict=True):
        assert {r.prompt_ids for r in x.requests}.isdisjoint(r.prompt_ids for r in y.requests)
    for scale, sizes in SCALE_SIZES.items():
        edit, agent, _ = build_workloads(_ByteTokenizer(), names, scale, seed=0)
        assert len(edit.requests) == sizes.edit_requests
        assert all(r.max_new_tokens == sizes.edit_new for r in edit.requests)
        assert len(agent.requests) == 4 * sizes.agent_conversations
        assert all(r.max_new_tokens == sizes.agent_new for r in agent.requests)


def test_edit_prompts_carry_a_whole_stdlib_file_and_predict_it() -> None:
    low, high = EDIT_LINES
    files = dict(edit_sources())
    assert len(files) >= 5 and set(files) <= {f"{m}.py" for m in EDIT_MODULES}
    assert all(low <= len(text.splitlines()) <= high for text in files.values())
    (edit,) = build_workloads(_ByteTokenizer(), ["edit"], "full", seed=1)
    assert edit.concurrency == 1 and len({r.prompt_ids for r in edit.requests}) == 4
    for r in edit.requests:
        prompt = bytes(r.prompt_ids).decode()
        assert r.prediction in files.values()  # the original file, as Predicted Outputs sends it
        assert f"```python\n{r.prediction}```" in prompt
        assert prompt.startswith("System: Session ")  # no chat template: plain text
        assert prompt.endswith("Return the whole file in one ```python block.\n\nAssistant:")
        renamed = re.search(r"Rename `(\w+)` to `(\w+)` everywhere", prompt)
        if renamed:  # a name the file really defines, to a new one
            assert renamed[1] in defined_names(r.prediction)
            assert renamed[2] not in r.prediction
    # Over a few seeds, every instruction is drawn.
    prompts = [
        bytes(r.prompt_ids).decode()
        for seed in range(6)
        for r in build_workloads(_ByteTokenizer(), ["edit"], "full", seed=seed)[0].requests
    ]
    for instruction in ("Add type hints", "Rename `", "Add a docstring"):
        assert any(instruction in p for p in prompts), instruction


def _agent_checks(agent: Workload, decode: Callable[[tuple[int, ...]], str]) -> None:
    """Four turns a conversation, in order; each turn's prompt extends the one before."""
    assert agent.concurrency == 1 and agent.follow_ups == ("turn 2", "turn 3", "turn 4")
    labels = [r.label for r in agent.requests]
    assert labels == ["turn 1", "turn 2", "turn 3", "turn 4"] * (len(labels) // 4)
    conversations = [agent.requests[i : i + 4] for i in range(0, len(labels), 4)]
    for turns in conversations:
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
            assert len(after.prompt_ids) > len(before.prompt_ids) + 10
        system = decode(turns[0].prompt_ids)
        assert all(tool["function"]["name"] in system for tool in AGENT_TOOLS)
        assert "# Repository map" in system and "    def " in system
    heads = {turns[0].prompt_ids[:16] for turns in conversations}
    assert len(heads) == len(conversations)  # no conversation shares another's first block


def test_agent_turns_share_a_growing_prefix() -> None:
    tok = _WordTokenizer()
    (agent,) = build_workloads(tok, ["agent"], "full", seed=2)
    assert len(agent.requests) == 8
    _agent_checks(agent, tok.decode)


def test_agent_and_edit_use_the_chat_template(default_tokenizer: PreTrainedTokenizerBase) -> None:
    edit, agent = build_workloads(default_tokenizer, ["edit", "agent"], "quick", seed=0)
    _agent_checks(agent, default_tokenizer.decode)
    system_tokens = SCALE_SIZES["quick"].agent_system
    first = len(agent.requests[0].prompt_ids)
    assert system_tokens <= first <= system_tokens * 1.2  # about the asked size
    for r in (*edit.requests, *agent.requests):
        text = default_tokenizer.decode(r.prompt_ids)
        assert text.startswith("<|im_start|>system\nSession ")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_prose_is_w1_again() -> None:
    w1, prose = build_workloads(_ByteTokenizer(), ["w1", "prose"], "full", seed=5)
    assert prose.name == "prose" and prose.requests == w1.requests and prose.concurrency == 1
    (alone,) = build_workloads(_ByteTokenizer(), ["prose"], "full", seed=5)
    assert alone == prose


def test_long_prompt_fills_its_size_and_is_salted() -> None:
    tok = _WordTokenizer()
    for scale, sizes in SCALE_SIZES.items():
        (request,) = build_workloads(tok, ["long"], scale, seed=0)[0].requests
        assert sizes.long_prompt * 0.9 <= len(request.prompt_ids) <= sizes.long_prompt
        assert request.max_new_tokens == sizes.long_new
    a, b = (build_workloads(tok, ["long"], "full", seed=s)[0].requests[0] for s in (1, 2))
    assert a.prompt_ids[:16] != b.prompt_ids[:16]


def test_follow_up_ttft_is_summarized_alone() -> None:
    def result(label: str, ttft: float) -> RequestResult:
        return RequestResult(0.0, [ttft, ttft + 0.1], 1.0, output_tokens=2, label=label)

    results = [result("turn 1", 2.0), result("turn 2", 0.2), result("turn 3", 0.4)]
    m = summarize(results, ("turn 2", "turn 3"))
    assert m["ttft_follow_up_ms"]["p50"] == pytest.approx(300.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(400.0)
    assert "ttft_follow_up_ms" not in summarize(results)


def test_draft_counters_from_prometheus_text() -> None:
    text = (
        "# HELP infer_draft_tokens_total Draft tokens verified (speculative decoding).\n"
        "# TYPE infer_draft_tokens_total counter\n"
        "infer_draft_tokens_total 120.0\n"
        "infer_draft_tokens_created 1.7e+09\n"
        "# TYPE infer_draft_tokens_accepted_total counter\n"
        'infer_draft_tokens_accepted_total{model="m"} 45.0\n'
        "infer_draft_acceptance_rate 0.375\n"
    )
    assert parse_draft_counters(text) == (120, 45)
    assert parse_draft_counters("infer_draft_tokens_total 3.0\n") is None


def test_speculative_systems_and_their_settings() -> None:
    # the flags bench gives `infer serve` are flags it takes
    for _, flags in INFER_SERVERS.values():
        cli.build_parser().parse_args(["serve", "--max-seq-len", "8192", *flags])
    variants = llama_variants("llama.cpp-ngram", ["--spec-type ngram-mod", "--spec-type x"])
    assert variants == {
        "llama.cpp-ngram": "--spec-type ngram-mod",
        "llama.cpp-ngram-2": "--spec-type x",
    }
    flags = variants | llama_variants("llama.cpp-draft", ["--spec-type draft-simple"])
    systems = ["llama.cpp", "llama.cpp-ngram", "infer-nospec", "llama.cpp-draft"]
    assert _with_variants(systems, flags) == [
        "llama.cpp",
        "llama.cpp-ngram",
        "llama.cpp-ngram-2",
        "infer-nospec",
        "llama.cpp-draft",
    ]
    assert _variant_of("llama.cpp-ngram-2") == "llama.cpp-ngram"
    assert _variant_of("llama.cpp") == "llama.cpp"
    settings = Settings(None, "default", "bfloat16")  # type: ignore[arg-type]
    assert settings.context(2048) == 2048
    settings.longest = 6500
    assert settings.context(2048) == 6656  # rounded up to 256


def test_prompt_source_wraps_around() -> None:
    source = PromptSource(_ByteTokenizer(), "abc")
    assert len(source.prompt(10, random.Random(0))) == 10


def test_markdown_marks_missing_values() -> None:
    metrics = summarize([RequestResult(0.0, [0.5], 1.0, output_tokens=1)])
    run = {
        "system": "sequential",
        "workload": "W1",
        "concurrency": 1,
        "rate": None,
        "serial": True,
        "metrics": metrics,
        "ratio_vs_sequential": 1.0,
    }
    report = {
        "meta": META,
        "workloads": [{"name": "W1", "description": "one", "levels": [1]}],
        "runs": [run],
        "unavailable": [{"system": "llama.cpp", "reason": "not installed"}],
        "goals": [],
        "files": {"throughput": "t.png", "latency": "l.png"},
    }
    text = markdown(report)
    assert "| sequential *(serial)* | 1.00 | 1.00× |" in text
    assert "llama.cpp: not installed" in text and "–" in text  # one token: no ITL
    assert "vLLM" not in text  # no vLLM run: no vLLM column


def _run(system: str, workload: str, tokens: int, ttft: float, concurrency: int = 1) -> dict:
    """A run whose wall time is 1 s: output tok/s == tokens, TTFT == ttft seconds."""
    result = RequestResult(0.0, [ttft] * tokens, 1.0, output_tokens=tokens)
    return {
        "system": system,
        "workload": workload,
        "concurrency": concurrency,
        "rate": None,
        "serial": False,
        "metrics": summarize([result]),
    }


def _w1(system: str, **extra: object) -> dict:
    """A W1 run of one request whose tokens come 20 ms apart."""
    result = RequestResult(0.0, [0.1 + 0.02 * i for i in range(11)], 1.0, output_tokens=11)
    return {
        "system": system,
        "workload": "W1",
        "concurrency": 1,
        "rate": None,
        "serial": False,
        "metrics": summarize([result]),
        **extra,
    }


def test_w1_share_is_over_the_probe_readings_around_it() -> None:
    """A step reading 1 GB every 20 ms moves 50 GB/s. Its share is over the mean of the probe
    readings just before and after its W1; readings further apart than STEADY_SPREAD mark
    the run as *moved*; a run without them falls back on the run's first reading. A run
    whose drafts were kept, a system that reads a dense copy (vLLM) and other loads get none."""
    assert STEADY_SPREAD == pytest.approx(0.10)
    runs = [
        _w1("infer-nospec", probes_gb_s=[50.0, 52.0]),
        _w1("llama.cpp", probes_gb_s=[50.0, 75.0]),
        _w1("sequential"),
        _w1("vllm", probes_gb_s=[50.0, 50.0]),
        _w1("infer-continuous", drafts={"drafted": 4, "accepted": 3}),
        _w1("infer-nospec", probes_gb_s=[50.0, 52.0]) | {"workload": "W2"},
    ]
    probe = {"gb_s": 40.0, "plain_gb_s": 39.0, "prefetch_gb_s": 40.0, "passes": 5, "threads": 2}
    meta = {"probe": probe | {"bytes": 2**30}, "bytes_per_token": 10**9}
    add_shares(runs, meta, reads_gguf, lambda r: bool(r.get("drafts", {}).get("accepted")))
    steady, moved, fallback, dense, drafted, other = runs
    assert steady["bandwidth"] == {
        "gb_s": 50.0,
        "of_probe": round(50 / 51, 4),
        "probe_gb_s": 51.0,
        "steady": True,
    }
    assert moved["bandwidth"]["of_probe"] == 0.8 and moved["bandwidth"]["steady"] is False
    assert fallback["bandwidth"] == {"gb_s": 50.0, "of_probe": 1.25, "probe_gb_s": 40.0}
    assert drafted["bandwidth"] == {"drafted": True}
    assert "bandwidth" not in dense and "bandwidth" not in other
    report = {"meta": META | {"bandwidth": meta | {"gguf": "m.gguf"}}, "runs": runs}
    text = bandwidth_table(report)
    assert "| infer-nospec | 20.0 | 50.0 | 50.0 / 52.0 | 98% |" in text
    assert "| llama.cpp | 20.0 | 50.0 | 50.0 / 75.0 | 80% (*moved*) |" in text
    assert "| sequential | 20.0 | 50.0 | – | 125% |" in text
    assert "| infer-continuous | drafted: not one step a token | – | – | – |" in text


def test_ratio_against_vllm_in_json_and_markdown() -> None:
    runs = [
        _run("sequential", "W2", 10, 0.5),
        _run("infer-continuous", "W2", 60, 0.2),
        _run("vllm", "W2", 40, 0.4),
        _run("infer-continuous", "chat64", 8, 0.1, 64),
        _run("infer-continuous", "sweep", 6, 0.1, 4),
        _run("vllm", "sweep", 3, 0.2, 4),
    ]
    add_ratios(runs)
    infer_w2, vllm_w2, infer_chat, infer_sweep = runs[1], runs[2], runs[3], runs[4]
    assert infer_w2["ratio_vs_sequential"] == 6.0
    assert infer_w2["ratio_vs_vllm"] == {"output_tok_s": 1.5, "ttft_p95": 0.5}
    assert vllm_w2["ratio_vs_vllm"] == {"output_tok_s": 1.0, "ttft_p95": 1.0}
    assert infer_chat["ratio_vs_vllm"] is None  # vLLM did not run chat64
    assert infer_sweep["ratio_vs_vllm"] == {"output_tok_s": 2.0, "ttft_p95": 0.5}
    report = {
        "meta": META | {"startup_s": {"vllm": 95.25}},
        "workloads": [
            {"name": "W2", "description": "two", "levels": [1]},
            {"name": "chat64", "description": "chat", "levels": [64]},
            {"name": "sweep", "description": "sw", "levels": [4]},
        ],
        "runs": runs,
        "unavailable": [],
        "goals": [],
        "files": {"throughput": "t.png", "latency": "l.png"},
    }
    text = markdown(report)
    assert "| × sequential | × vLLM tok/s; TTFT p95 | req/s |" in text
    assert "| infer-continuous | 60.0 | 6.00× | 1.50×; 0.50× |" in text
    assert "| infer-continuous | 8.00 | – | –; – |" in text
    assert "6.00 (–), 100 ms; 2.00×; 0.50×" in text
    assert "vllm 95.2 s" in text
    assert "× vLLM" not in markdown(report | {"runs": [_run("sequential", "W2", 1, 0.5)]})


def test_markdown_shows_drafts_and_later_turns() -> None:
    agent = [
        RequestResult(0.0, [0.5, 0.6], 1.0, output_tokens=2, label="turn 1"),
        RequestResult(1.0, [1.1, 1.2], 2.0, output_tokens=2, label="turn 2"),
    ]
    run = {
        "system": "infer-continuous",
        "workload": "agent",
        "concurrency": 1,
        "rate": None,
        "serial": False,
        "metrics": summarize(agent, ("turn 2",)),
        "drafts": {"drafted": 40, "accepted": 10, "acceptance": 0.25},
    }
    peer = _run("llama.cpp-ngram", "agent", 2, 0.3)
    report = {
        "meta": META,
        "workloads": [{"name": "agent", "description": "turns", "levels": [1]}],
        "runs": [run, peer],
        "unavailable": [],
        "goals": [],
        "files": {"throughput": "t.png", "latency": "l.png"},
    }
    text = markdown(report)
    assert "| TTFT p50 / p95 / p99 ms | later turns TTFT p50 ms | ITL" in text
    assert "| errors | drafts accepted |\n|" + "---|" * 11 + "\n" in text
    assert "| 100 | 100 / 100 / 100 |" in text  # turn 2's TTFT alone
    assert text.count("| 0 | 25% of 40 |") == 1 and "| 0 | – |" in text
    assert "drafts accepted" not in markdown(report | {"runs": [peer]})


class _FakeServer:
    """A native SSE endpoint that counts how many streams are open at once."""

    def __init__(self) -> None:
        self.open = 0
        self.most_open = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await trio.sleep(0.01)
        finally:
            self.open -= 1
        events = ['event: started\ndata: {"id": "x"}\n\n']
        events += [f'event: token\ndata: {{"i": {i}}}\n\n' for i in range(body["max_tokens"])]
        usage = {"completion_tokens": body["max_tokens"]}
        events.append(f"event: done\ndata: {json.dumps({'usage': usage})}\n\n")
        return httpx.Response(200, content="".join(events).encode())


def _workload(n: int, concurrency: int, rate: float | None = None) -> Workload:
    requests = tuple(BenchRequest((1, 2), 3) for _ in range(n))
    return Workload("W2", "fake", requests, concurrency, rate)


async def test_closed_loop_keeps_concurrency() -> None:
    server = _FakeServer()
    done: list[RequestResult] = []
    results = await run_workload(
        Target("http://fake"), _workload(7, 3), done.append, transport=httpx.MockTransport(server)
    )
    assert len(results) == len(done) == 7 and server.most_open == 3
    assert all(r.ok and r.output_tokens == 3 and len(r.token_times) == 3 for r in results)


async def test_poisson_arrivals_follow_the_seeded_schedule() -> None:
    rate, n, seed = 40.0, 5, 7
    arrivals = random.Random(f"arrivals/{seed}")
    earliest = sum(arrivals.expovariate(rate) for _ in range(n))  # the last request's arrival
    t0 = time.perf_counter()
    results = await run_workload(
        Target("http://fake"),
        _workload(n, n, rate),
        seed=seed,
        transport=httpx.MockTransport(_FakeServer()),
    )
    assert all(r.ok for r in results)
    assert max(r.start for r in results) - t0 >= earliest * 0.999
    assert [r.start for r in results] == sorted(r.start for r in results)


async def test_http_errors_are_counted_not_raised() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"code": "OVERLOADED"}})

    results = await run_workload(
        Target("http://fake"), _workload(2, 2), transport=httpx.MockTransport(refuse)
    )
    assert [r.error for r in results] == ["HTTP_503", "HTTP_503"]
    assert summarize(results)["errors"] == 2
