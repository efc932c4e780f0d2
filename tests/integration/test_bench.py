"""``infer bench`` end to end at smoke scale: the report is complete and plausible.

It loads the real default model, starts real servers (static and continuous batching, and
continuous without prefix caching) as subprocesses, and measures a couple of tiny requests per
workload, the chat-sized, one-at-a-time and shared-prefix loads included (vLLM is not needed),
and the memory-read probe on a small buffer. The coding-agent loads (edit, agent, prose) and
the long prompt run against an app at ``--url``, with predictions.
It checks what the report holds, never how fast anything was: timings on a shared 2-core
machine are noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from quart import request

from infer import cli
from infer.bench.bandwidth import decode_bytes
from infer.bench.main import SMOKE_PROBE_BYTES
from infer.bench.metrics import LATENCY_METRICS
from infer.bench.workloads import SCALE_SIZES, edit_sources
from infer.models.default import default_gguf_path
from infer.models.gguf_file import GGUFFile
from infer.models.packaged import assemble
from support.server import running_server

pytestmark = pytest.mark.slow

SYSTEMS = ["sequential", "hf-batched", "infer-static", "infer-continuous", "infer-noprefix"]
WORKLOADS = ["W1", "W2", "W2-serial", "chat64", "prefix"]  # and the sweep
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_PNG_BYTES = 200_000  # small enough to commit
CODING_LOADS = ["edit", "agent", "prose", "long"]  # measured at --url


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    default_gguf_path()  # the default model must be installed (make test installs it)
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "bench",
        "--scale",
        "smoke",
        "--systems",
        ",".join(SYSTEMS),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    return out


def _report(out: Path) -> dict[str, Any]:
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())


def _markdown(out: Path, report: dict[str, Any]) -> str:
    return (out / report["files"]["md"]).read_text()


def _bench_url(url: str, out: Path, workloads: str, *more: str) -> int:
    """``infer bench`` at smoke scale on the server at ``url`` alone (system ``url``)."""
    argv = ["bench", "--scale", "smoke", "--systems", "url", "--workloads", workloads]
    return cli.main([*argv, "--url", url, "--out", str(out), "--no-progress", *more])


def test_files_are_written(report_dir: Path) -> None:
    (json_path,) = report_dir.glob("*.json")
    stem = json_path.stem
    for suffix in (".md", "-throughput.png", "-latency.png"):
        assert (report_dir / f"{stem}{suffix}").is_file()
    for png in report_dir.glob("*.png"):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) < MAX_PNG_BYTES


def test_every_run_has_every_metric(report_dir: Path) -> None:
    report = _report(report_dir)
    scale = SCALE_SIZES["smoke"]
    expected_runs = {(s, w) for s in SYSTEMS for w in WORKLOADS}
    assert expected_runs <= {(r["system"], r["workload"]) for r in report["runs"]}
    sweep = {(r["system"], r["concurrency"]) for r in report["runs"] if r["workload"] == "sweep"}
    for system in SYSTEMS[1:]:
        assert {(system, c) for c in scale.concurrency} <= sweep
    assert ("sequential", 1) in sweep  # serial: measured once
    workloads = {w["name"]: w for w in report["workloads"]}
    for run in report["runs"]:
        m = run["metrics"]
        assert m["errors"] == 0 and m["short"] == 0
        assert m["completed"] == m["requests"] == workloads[run["workload"]]["requests"]
        assert m["output_tokens"] == workloads[run["workload"]]["output_tokens"]
        assert m["output_tok_s"] > 0 and m["req_s"] > 0 and m["wall_s"] > 0
        assert run["ratio_vs_sequential"] > 0
        assert "ratio_vs_vllm" not in run  # vLLM did not run
        for name in LATENCY_METRICS:
            stats = m[name]
            assert set(stats) == {"p50", "p95", "p99", "mean"}, name
            assert 0 < stats["p50"] <= stats["p95"] <= stats["p99"], (run["system"], name)
        # a request's first token comes before its end, and a stream outlasts one gap
        assert m["ttft_ms"]["p50"] <= m["e2e_ms"]["p99"]
        assert m["itl_ms"]["mean"] <= m["e2e_ms"]["mean"]


def test_meta_goals_and_markdown(report_dir: Path) -> None:
    report = _report(report_dir)
    meta = report["meta"]
    assert meta["model"] == "SmolLM2-135M-Instruct" and meta["dtype"] == "bfloat16"
    assert meta["forward_step_ms"] > 0
    assert [g["value"] is not None for g in report["goals"]] == [True, True, True]
    assert set(meta["startup_s"]) == {"infer-static", "infer-continuous", "infer-noprefix"}
    md = _markdown(report_dir, report)
    assert "vLLM" not in md
    for text in (
        *(f"## {w}:" for w in WORKLOADS),
        "## Concurrency sweep",
        "## Memory bandwidth",
        "## Goals",
        *SYSTEMS,
        report["files"]["throughput"],
        report["files"]["latency"],
    ):
        assert text in md


def test_w1_bandwidth_against_the_probe(report_dir: Path) -> None:
    """The read probe ran (on smoke's small buffer) with the servers' thread count; a decode
    step reads the whole default GGUF file's tensors (its embeddings are its head too); each
    W1 run of infer's systems has its share of the probe readings taken just before and
    after it, transformers' has none, and a run whose drafts were kept (tokens several a
    step) is marked instead of given one."""
    report = _report(report_dir)
    meta = report["meta"]
    bandwidth = meta["bandwidth"]
    probe = bandwidth["probe"]
    assert probe["gb_s"] > 0 and probe["threads"] == meta["torch_threads"]
    assert probe["bytes"] == SMOKE_PROBE_BYTES
    tensors = GGUFFile(default_gguf_path()).tensors
    assert bandwidth["bytes_per_token"] == sum(t.data.nbytes for t in tensors)
    w1 = {r["system"]: r for r in report["runs"] if r["workload"] == "W1"}
    assert "bandwidth" not in w1.pop("hf-batched")
    assert set(w1) == set(SYSTEMS) - {"hf-batched"}
    assert w1["sequential"]["bandwidth"]["of_probe"] > 0  # generate() never drafts
    for run in w1.values():
        share = run["bandwidth"]
        if share.get("drafted"):
            assert run["drafts"]["accepted"] > 0
            continue
        # the probe ran again just before and after the run, and the share is over those
        before, after = run["probes_gb_s"]
        assert before > 0 and after > 0
        assert share["probe_gb_s"] == round((before + after) / 2, 2)
        # (of the unrounded GB/s: within the rounding of the two figures the report keeps)
        mean = (before + after) / 2
        low, high = (share["gb_s"] - 0.005) / mean, (share["gb_s"] + 0.005) / mean
        assert low - 5e-5 <= share["of_probe"] <= high + 5e-5
        assert share["steady"] == (max(before, after) <= min(before, after) * 1.1)
    assert "| probe before / after, GB/s |" in _markdown(report_dir, report)


def test_decode_bytes_read_one_embedding_row_beside_a_head() -> None:
    """A file with its own output head (Qwen2.5-Coder-0.5B's): every tensor but the token
    embeddings, and one row of those."""
    tensors = {t.name: t.data for t in GGUFFile(assemble("qwen2.5-coder-0.5b")).tensors}
    embeddings = tensors.pop("token_embd.weight")
    assert "output.weight" in tensors
    rest = sum(t.nbytes for t in tensors.values())
    assert decode_bytes(assemble("qwen2.5-coder-0.5b")) == rest + embeddings[0].nbytes


async def test_sampled_load_reaches_the_server(tmp_path: Path, real_app) -> None:
    """--temperature and --top-p go into every server request: the sampled chat load runs
    with no error, every request to its token count unless it sampled EOS first (counted
    short), and the report says how it sampled.

    Measured at ``--url`` (the report's infer servers above are the ones bench starts): an
    app on the session's default model, sized as ``infer serve`` sizes it, so that no
    server process starts here. bench runs its own event loops: in a worker thread."""

    def bench(url: str, out: Path, top_p: str) -> int:
        return _bench_url(url, out, "chat64", "--temperature", "0.8", "--top-p", top_p)

    app = real_app(engine={"max_seq_len": 2048, "max_batch_size": 64})
    async with running_server(app) as server:
        sampled = await trio.to_thread.run_sync(bench, server.url, tmp_path, "0.9")
        # The fields really go out: given a top_p it refuses, the server is not measured.
        bad = tmp_path / "bad"
        refused_status = await trio.to_thread.run_sync(bench, server.url, bad, "1.5")
    assert sampled == 0
    report = _report(tmp_path)
    (run,) = report["runs"]
    (workload,) = report["workloads"]
    assert run["system"] == "url" and run["metrics"]["errors"] == 0
    metrics = run["metrics"]
    # EOS is honoured when sampling: a request that draws it early is short, not an error
    assert metrics["output_tokens"] <= workload["output_tokens"]
    assert (metrics["output_tokens"] == workload["output_tokens"]) == (metrics["short"] == 0)
    (note,) = [n for n in report["meta"]["notes"] if n.startswith("Sampled")]
    assert "temperature 0.8" in note and "top_p 0.9" in note
    assert note in _markdown(tmp_path, report)
    assert refused_status == 1
    refused = _report(bad)
    assert refused["runs"] == []
    (unavailable,) = refused["unavailable"]
    assert "top_p" in unavailable["reason"]


async def test_coding_agent_loads_with_predictions(tmp_path: Path, real_app) -> None:
    """edit, agent, prose and long at smoke scale, each edit sent with its file as the
    prediction: no errors, the server's draft counters over each load, the later turns' TTFT
    alone.

    Measured at ``--url`` (an app on the session's model, no server process to start)."""
    app = real_app(engine={"max_seq_len": 8192, "max_batch_size": 4})
    predictions: list[Any] = []

    @app.before_request
    async def record() -> None:
        if request.path == "/v1/generate":
            predictions.append((await request.get_json()).get("prediction"))

    async with running_server(app) as server:
        status = await trio.to_thread.run_sync(
            _bench_url, server.url, tmp_path, ",".join(CODING_LOADS), "--predictions"
        )
    assert status == 0
    files = {text for _, text in edit_sources()}
    sent = [p["content"] for p in predictions if p is not None]
    assert len(sent) == SCALE_SIZES["smoke"].edit_requests and set(sent) <= files
    assert all(p == {"type": "content", "content": p["content"]} for p in predictions if p)
    report = _report(tmp_path)
    runs = {r["workload"]: r for r in report["runs"]}
    assert set(runs) == set(CODING_LOADS)
    for run in runs.values():
        assert run["metrics"]["errors"] == 0 and run["metrics"]["short"] == 0
        drafts = run["drafts"]
        assert 0 <= drafts["accepted"] <= drafts["drafted"]
    assert runs["agent"]["metrics"]["requests"] == 4
    assert runs["agent"]["metrics"]["ttft_follow_up_ms"]["p50"] > 0
    assert runs["long"]["metrics"]["requests"] == 1
    long_prompt = runs["long"]["metrics"]["prompt_tokens"]
    assert SCALE_SIZES["smoke"].long_prompt * 0.9 <= long_prompt <= SCALE_SIZES["smoke"].long_prompt
    md = _markdown(tmp_path, report)
    for text in (
        *(f"## {name}:" for name in CODING_LOADS),
        "later turns TTFT p50 ms",
        "drafts accepted",
    ):
        assert text in md
