"""The server's pure parts: config from the environment, limits, metrics text, SSE framing."""

from __future__ import annotations

import pytest

from infer.api.errors import APIError, ErrorCode, error_body
from infer.engine.prompts import check_size
from infer.engine.request import Failure, Refusal, RequestError
from infer.server.config import ServerConfig
from infer.server.edge import framing as sse
from infer.server.edge.access import ApiKeys, RateLimiter
from infer.server.host.metrics import Histogram, Live, Metrics
from support.server import parse_sse


def test_config_from_env() -> None:
    config = ServerConfig.from_env(
        {
            "INFER_PORT": "9000",
            "INFER_API_KEYS": "a, b,,",
            "INFER_CORS_ORIGINS": "https://x/",
            "INFER_RATE_LIMIT": "30",
            "INFER_MAX_TIMEOUT_S": "none",
            "INFER_HEARTBEAT_S": "2.5",
            "INFER_MODEL": "/models/m",
            "INFER_BATCHING_MODE": "static",
            "INFER_SEED": "7",
            "UNRELATED": "x",
        }
    )
    assert (config.port, config.api_keys, config.cors_origins) == (9000, ("a", "b"), ("https://x",))
    assert (config.rate_limit, config.max_timeout_s, config.heartbeat_s) == (30, None, 2.5)
    assert (config.engine.model, config.engine.batching_mode, config.engine.seed) == (
        "/models/m",
        "static",
        7,
    )
    assert ServerConfig.from_env({}) == ServerConfig()


@pytest.mark.parametrize(
    "env, name",
    [
        ({"INFER_PORT": "http"}, "INFER_PORT"),
        ({"INFER_PORT": "70000"}, "port"),
        ({"INFER_HEARTBEAT_S": "0"}, "heartbeat_s"),
        ({"INFER_BATCHING_MODE": "eager"}, "batching_mode"),
        ({"INFER_MAX_WAITING_REQUESTS": "0"}, "max_waiting_requests"),  # would refuse everything
    ],
)
def test_config_errors_name_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ServerConfig.from_env(env)


def test_rate_limiter_refills() -> None:
    now = [0.0]
    limiter = RateLimiter(per_minute=60, burst=2, clock=lambda: now[0])
    limiter.acquire("a")
    limiter.acquire("a")
    with pytest.raises(APIError) as e:
        limiter.acquire("a")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    limiter.acquire("b")  # per client
    now[0] = 1.0  # one request per second
    limiter.acquire("a")
    with pytest.raises(APIError):
        limiter.acquire("a")


def test_rate_limiter_drops_idle_clients() -> None:
    now = [0.0]
    limiter = RateLimiter(per_minute=60, burst=1, clock=lambda: now[0], max_clients=2)
    limiter.acquire("a")
    limiter.acquire("b")
    now[0] = 5.0  # both buckets are full again
    limiter.acquire("c")
    assert set(limiter._buckets) == {"c"}


def test_api_keys() -> None:
    keys = ApiKeys(["secret"])
    keys.check("Bearer secret")
    keys.check("bearer  secret ")
    for header in (None, "", "Bearer", "Bearer secre", "Bearer secrets", "Token secret"):
        with pytest.raises(APIError) as e:
            keys.check(header)
        assert e.value.status == 401
    ApiKeys([]).check(None)  # disabled


def test_prompt_size_counts_utf8_bytes() -> None:
    check_size("é" * 8, 16)
    with pytest.raises(RequestError) as e:
        check_size("é" * 9, 16)
    assert e.value.reason is Refusal.PROMPT_TOO_LARGE
    assert ErrorCode.of(e.value.reason).status == 413


def test_every_error_code_is_defined_once_with_its_answer() -> None:
    assert len({c.value for c in ErrorCode}) == len(ErrorCode)
    assert all(c.value == c.name.lower() for c in ErrorCode)
    assert all(c.status >= 500 or not c.retryable or c.status == 429 for c in ErrorCode)
    error = APIError(ErrorCode.QUEUE_FULL)
    assert (error.status, error.headers, error_body(error)["error"]["code"]) == (
        503,
        {"Retry-After": "1"},
        "queue_full",
    )
    assert ErrorCode.TIMEOUT.finish_reason == "length"
    assert ErrorCode.CANCELLED.finish_reason == "abort"
    # Every outcome the engine reports has its answer in the table.
    assert all(ErrorCode.of(o).value == o.value for o in [*Failure, *Refusal])


def test_histogram_and_metrics_text() -> None:
    h = Histogram("x_seconds", "help", [0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 3.0, float("nan")):
        h.observe(v)
    lines = h.render()
    # prometheus-client writes every value as a float
    assert 'x_seconds_bucket{le="0.1"} 2.0' in lines
    assert 'x_seconds_bucket{le="1.0"} 3.0' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4.0' in lines and "x_seconds_count 4.0" in lines
    text = Metrics().render("m", Live(running=2, waiting=5, ready=True))
    assert 'infer_requests_running{model="m"} 2.0\n' in text
    assert 'infer_requests_waiting{model="m"} 5.0\n' in text
    assert 'infer_requests_total{finish_reason="eos",model="m"} 0.0' in text
    assert text.endswith("\n")


def test_sse_framing_round_trips() -> None:
    blob = sse.event({"t": "a\nb 😀"}, "token", 7) + sse.HEARTBEAT + sse.event({"x": 1}) + sse.DONE
    events = parse_sse(blob.decode())
    # As EventSource reads it: an unnamed event is a "message", the last id carries over.
    assert [(e.event, e.comment, e.id) for e in events] == [
        ("token", None, "7"),
        ("", "keep-alive", ""),
        ("message", None, "7"),
        ("message", None, "7"),
    ]
    assert events[0].json() == {"t": "a\nb 😀"} and events[-1].data == "[DONE]"
    assert sse.split(blob) == [
        sse.event({"t": "a\nb 😀"}, "token", 7),
        sse.event({"x": 1}),
        sse.DONE,
    ]  # the log of a resumable stream: no heartbeats


def test_malloc_arenas_are_capped_unless_the_environment_says(monkeypatch) -> None:
    from infer.server.serve import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # the operator's setting wins
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_malloc_arenas() is True  # glibc (this machine): mallopt accepted it


async def test_a_resume_reader_never_skips_events_appended_while_it_sends() -> None:
    """Events logged while the reader is suspended sending its last batch come next."""
    from infer.server.host.resume import ResumableStream

    stream = ResumableStream("job", "key", window_s=10, heartbeat_s=10)

    def log(i: int) -> None:
        stream.events += sse.split(sse.event({"i": i}, "token", i) + sse.HEARTBEAT)

    log(0)
    reader = stream.read(-1)
    first = await reader.__anext__()
    log(1)  # the reader is suspended in its yield: it has not asked for more yet
    log(2)
    stream.finished = True
    rest = [blob async for blob in reader]
    ids = [e.id for e in parse_sse((first + b"".join(rest)).decode())]
    assert ids == ["0", "1", "2"]


def test_hypercorn_settings_can_come_from_its_toml_file() -> None:
    from pathlib import Path

    from infer.server.serve import hypercorn_config

    toml = Path(__file__).parents[2] / "hypercorn.toml"
    hyper = hypercorn_config(ServerConfig(port=1234), path=str(toml))
    assert hyper.bind == ["127.0.0.1:8000"] and hyper.graceful_timeout == 30
    assert hypercorn_config(ServerConfig(port=1234)).bind == ["127.0.0.1:1234"]


def test_every_config_field_is_a_serve_flag() -> None:
    import dataclasses

    from infer.cli import build_parser, config_values
    from infer.engine.config import EngineConfig

    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--no-prefix-caching",
            "--max-seq-len",
            "128",
            "--rate-limit",
            "30",
            "--dtype",
            "float32",
            "--settle-min-rows",
            "0",
        ]
    )
    server, engine = config_values(args, ServerConfig), config_values(args, EngineConfig)
    assert server == {"api_keys": ("a", "b"), "rate_limit": 30.0, "settle_min_rows": 0}
    assert engine == {"prefix_caching": False, "max_seq_len": 128, "dtype": "float32"}
    import argparse

    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    dests = {a.dest for a in commands.choices["serve"]._actions}
    fields = {f.name for c in (ServerConfig, EngineConfig) for f in dataclasses.fields(c)}
    assert fields - {"engine", "model"} <= dests  # the engine's model: one plain --model
    models = parser.parse_args(["serve", "--model", "chat=default", "--model", "e5"])
    assert config_values(models, ServerConfig) == {"models": ("chat=default", "e5")}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dtype", "int3"])


async def test_the_api_docs_group_every_route_and_read_as_plain_text() -> None:
    from infer.server.app import create_app

    client = create_app(ServerConfig()).test_client()  # no model: the document needs none
    doc = await (await client.get("/openapi.json")).get_json()
    groups = {t["name"] for t in doc["tags"]}
    assert groups == {
        "OpenAI",
        "Anthropic",
        "Ollama",
        "native",
        "tokens",
        "code completion",
        "operations",
    }
    operations = [op for ops in doc["paths"].values() for op in ops.values()]
    assert len(operations) >= 15
    for op in operations:
        assert len(op["tags"]) == 1 and op["tags"][0] in groups, op
        summary = op["summary"]
        assert summary.endswith(".") and "``" not in summary and ":class:" not in summary, op
    for schema in doc["components"]["schemas"].values():
        assert "``" not in schema.get("description", ""), schema
