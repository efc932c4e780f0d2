"""``infer cluster`` for real: replicas of the default model behind SGLang Model Gateway.

Each test runs the command as a subprocess (as a user would), reads the addresses it
prints, and talks to the gateway and the replicas over loopback.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest
import trio

from infer.bench.servers import infer_command, running_server
from infer.procs import free_port

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240.0  # two model loads on a busy 2-core machine
STOP_TIMEOUT_S = 60.0
SERVE = ["--max-seq-len", "512", "--max-batch-size", "8", "--log-level", "warning"]
LINE = re.compile(r"^(replica \d+|gateway): (\S+) \(pid (\d+)")


@dataclass
class Running:
    process: subprocess.Popen[str]
    gateway: str
    replicas: dict[str, str]  # url -> name
    pids: list[int]  # the gateway's, then each local replica's
    lines: list[str]  # its stdout
    errors: list[str]  # its stderr (and the logs of the pieces)


def _read_lines(stream: IO[str], lines: list[str], done: threading.Event) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        if line.startswith("gateway:"):
            done.set()
    done.set()


@contextlib.contextmanager
def cluster(*args: str) -> Iterator[Running]:
    """``infer cluster ARGS`` on a free gateway port until its address lines are out; SIGTERM
    at the end (if it still runs)."""
    command = [
        sys.executable,
        "-m",
        "infer",
        "cluster",
        "--port",
        str(free_port()),
        "--gateway-metrics-port",
        str(free_port()),
        "--gateway-arg=--log-level=warn",
        *args,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    errors: list[str] = []
    done = threading.Event()
    for stream, into, event in (
        (process.stdout, lines, done),
        (process.stderr, errors, threading.Event()),
    ):
        reader = threading.Thread(target=_read_lines, args=(stream, into, event))
        reader.daemon = True
        reader.start()
    try:
        assert done.wait(STARTUP_TIMEOUT_S), f"no gateway line; output: {lines} {errors[-20:]}"
        assert process.poll() is None, f"exited {process.returncode}; output: {lines}"
        found = [m.groups() for m in map(LINE.match, lines) if m]
        gateway = [(url, int(pid)) for name, url, pid in found if name == "gateway"]
        replicas = {url: name for name, url, _ in found if name != "gateway"}
        pids = [gateway[0][1], *(int(pid) for name, _, pid in found if name != "gateway")]
        yield Running(process, gateway[0][0], replicas, pids, lines, errors)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def _metric(url: str, name: str) -> float:
    """The sum of every sample of ``name`` in ``url``'s /metrics."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(url + "/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _chat(client: httpx.AsyncClient, content: str, max_tokens: int = 8) -> str:
    body = {
        "model": "default",
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return "".join([chunk async for chunk in r.aiter_text()])


def _prefixes(seed: int, n: int) -> list[str]:
    """``n`` different long texts (~400 tokens each) of random words."""
    rng = random.Random(seed)
    words = "river stone cloud amber signal harbor lantern meadow copper violet orbit".split()
    return [" ".join(rng.choice(words) for _ in range(380)) for _ in range(n)]


async def _prefix_hit_rate(gateway: str, replicas: list[str], seed: int) -> float:
    """Send 8 shared prefixes x 4 questions each, in 4 waves (one request per prefix per
    wave, in a shuffled order, one at a time); return the share of the prompt tokens the
    replicas' prefix caches served, from their /metrics."""
    before = [
        (
            await _metric(url, "infer_prompt_tokens_total"),
            await _metric(url, "infer_prompt_tokens_cached_total"),
        )
        for url in replicas
    ]
    prefixes = _prefixes(seed, 8)
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        for wave in range(4):
            order = list(range(8))
            rng.shuffle(order)
            for p in order:
                text = await _chat(client, f"{prefixes[p]}\n\nQuestion {wave}: which word?", 2)
                assert text.endswith("data: [DONE]\n\n"), text
    prompt = cached = 0.0
    for url, (prompt_before, cached_before) in zip(replicas, before, strict=True):
        prompt += await _metric(url, "infer_prompt_tokens_total") - prompt_before
        cached += await _metric(url, "infer_prompt_tokens_cached_total") - cached_before
    assert prompt > 8 * 4 * 300
    return cached / prompt


async def test_a_cluster_routes_by_prefix_serves_32_streams_and_stops_on_sigterm() -> None:
    """Two replicas behind the cache-aware gateway: prompts that share a prefix go where it
    is cached (more hits than a round-robin gateway in front of the same replicas); 32
    concurrent streams spread over both; SIGTERM stops every process, exit status 0."""
    # Room for every prefix of both runs on each replica: no eviction blurs the comparison.
    serve = [*SERVE, "--kv-cache-gb", "0.3"]
    # cache_aware sends prompts that share most of their text (here the chat template) to
    # one replica until the load differs by --balance-abs-threshold requests (64 by
    # default): lowered, so that 32 streams spread. The prefix runs send one at a time.
    balance = "--gateway-arg=--balance-abs-threshold=4"
    args = ("--replicas", "2", "--policy", "cache_aware", balance)
    with cluster(*args, "--", *serve) as running:
        assert len(running.replicas) == 2
        replicas = list(running.replicas)
        aware = await _prefix_hit_rate(running.gateway, replicas, seed=1)
        # A second gateway, round-robin, in front of the same replicas (new prefixes).
        urls = [arg for url in replicas for arg in ("--worker-url", url)]
        with cluster(*urls, "--policy", "round_robin") as robin:
            assert robin.replicas == {}  # only the gateway started
            rr = await _prefix_hit_rate(robin.gateway, replicas, seed=2)

        before = [await _metric(url, "infer_requests_total") for url in replicas]
        texts: list[str] = []
        async with httpx.AsyncClient(base_url=running.gateway, timeout=120) as client:

            async def one(i: int) -> None:
                texts.append(await _chat(client, f"Name a colour, please ({i})."))

            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(one, i)
        served = [
            await _metric(url, "infer_requests_total") - n
            for url, n in zip(replicas, before, strict=True)
        ]
        running.process.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(running.process.wait, STOP_TIMEOUT_S)
    print(f"\nprefix cache hit rate: cache_aware {aware:.1%}, round_robin {rr:.1%}")
    assert aware > rr + 0.1
    assert len(texts) == 32
    for text in texts:
        assert text.endswith("data: [DONE]\n\n") and text.count("data: [DONE]") == 1, text
    assert all(n > 0 for n in served), served  # both replicas took a share
    assert sum(served) == 32
    assert code == 0
    assert not [pid for pid in running.pids if _alive(pid)]


async def _until_each_runs(urls: list[str]) -> None:
    """Wait until every replica in ``urls`` is generating a request at the same moment."""
    while min([await _metric(url, "infer_requests_running") for url in urls]) < 1:
        await trio.sleep(0.2)


async def test_cluster_stops_everything_and_fails_when_a_replica_dies() -> None:
    with cluster("--replicas", "2", "--", *SERVE) as running:
        os.kill(running.pids[1], signal.SIGKILL)  # replica 1
        code = await trio.to_thread.run_sync(running.process.wait, STOP_TIMEOUT_S)
    assert code == 1
    assert not [pid for pid in running.pids if _alive(pid)]
    said = [line for line in running.errors if line.startswith("infer cluster: error:")]
    assert len(said) == 1 and "replica 1" in said[0] and "exited unexpectedly" in said[0], said


async def _refused(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            await client.get(url + "/health")
    except httpx.TransportError:
        return True
    return False


async def _long_streams(client: httpx.AsyncClient, n: int, results: list[str]) -> None:
    """``n`` streams of 200 tokens; each ends as ``done``, ``cut``, ``error`` or ``broken``."""

    async def one(i: int) -> None:
        body = {
            "model": "default",
            "stream": True,
            "max_tokens": 200,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell a long story ({i})."}],
        }
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                text = "".join([chunk async for chunk in r.aiter_text()])
            results.append("done" if "[DONE]" in text else "cut")
            if '"error"' in text:
                results[-1] = "error"
        except httpx.HTTPError:
            results.append("broken")

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)


async def test_a_replica_drained_restarted_then_killed_under_load() -> None:
    """Two replicas behind a round-robin gateway.

    SIGTERM to the first under load (with a drain grace): its running streams finish,
    requests that arrive meanwhile are served by the other (none is lost), and once it is
    started again the gateway sends it requests again. Then SIGKILL to it mid-load: its
    streams end (none hangs), the other's finish, and the gateway goes on serving.
    """
    ports = [free_port(), free_port()]
    serve = [*SERVE[:4], "--drain-grace-s", "60"]
    commands = [infer_command(port, "continuous", "default", "bfloat16", serve) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    checks = "--gateway-arg=--health-check-interval-secs=1"
    with (
        running_server(commands[1], urls[1], "/health"),
        contextlib.ExitStack() as first,
    ):
        one = first.enter_context(running_server(commands[0], urls[0], "/health"))
        with cluster(
            "--worker-url", urls[0], "--worker-url", urls[1], "--policy", "round_robin", checks
        ) as running:
            texts: list[str] = []
            async with httpx.AsyncClient(base_url=running.gateway, timeout=120) as client:

                async def stream(i: int) -> None:
                    texts.append(await _chat(client, f"Tell a story ({i}).", max_tokens=48))

                with trio.fail_after(120):
                    async with trio.open_nursery() as nursery:
                        for i in range(8):
                            nursery.start_soon(stream, i)
                        await _until_each_runs(urls)
                        os.kill(one.pid, signal.SIGTERM)
                        await trio.sleep(0.5)
                        for i in range(6):  # while the first replica drains
                            nursery.start_soon(stream, 100 + i)
                    while not await _refused(urls[0]):  # it drained and exited
                        await trio.sleep(0.2)
                first.close()
                # started again on its port: the gateway's health checks let it back in
                one = first.enter_context(running_server(commands[0], urls[0], "/health"))
                with trio.fail_after(90):
                    while await _metric(urls[0], "infer_requests_total") < 1:
                        texts.append(await _chat(client, "Say hello."))

                results: list[str] = []
                with trio.fail_after(90):  # every stream ends: none hangs
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_long_streams, client, 8, results)
                        await _until_each_runs(urls)
                        os.kill(one.pid, signal.SIGKILL)  # outright, mid-stream
                after = [await _chat(client, f"Say hello ({i}).") for i in range(6)]
            assert running.process.poll() is None  # the gateway outlives a replica it fronts
    assert len(texts) >= 8 + 6 + 1
    for text in texts:  # every stream ran to its end: none was cut or lost
        assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text
        assert text.count('"finish_reason":"length"') == 1 or '"finish_reason":"stop"' in text
    print(f"\nstreams when a replica was killed: {sorted(results)}")
    assert len(results) == 8
    assert any(r != "done" for r in results), results  # the killed replica's streams
    assert any(r == "done" for r in results), results  # the other one's
    for text in after:
        assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text
