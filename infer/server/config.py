"""Server settings: one dataclass, built from CLI flags or ``INFER_*`` environment variables."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from infer.catalog import ModelSpec, model_specs, parse_keep_alive
from infer.engine.config import EngineConfig

FIM_LAYOUTS = ("anchored", "psm", "spm")


@dataclass
class ServerConfig:
    """How the HTTP server listens, limits clients and feeds the engine.

    Args:
        host: Address to bind.
        port: Port to bind (0 picks a free one).
        api_keys: Accepted bearer tokens; empty disables authentication.
        cors_origins: Origins allowed to call the API from a browser; ``"*"`` allows any.
        max_prompt_bytes: Longest prompt, in UTF-8 bytes of prompt text (the rendered chat
            transcript for ``messages``); longer ones get 413. ``None``: 16 bytes per token of
            the max sequence length (a guard before tokenizing; the token count is the limit).
        max_body_bytes: Longest request body; longer ones get 413.
        rate_limit: Requests per minute per client (API key, else address); ``None`` is off.
        rate_burst: Requests a client may make at once before the rate applies.
        heartbeat_s: Seconds of silence after which a stream gets an SSE comment.
        max_timeout_s: Longest a generation may run; caps each request's ``timeout_s``
            (``None``: no cap).
        output_buffer: Outputs queued per stream before the worker starts coalescing.
        max_pending_tokens: Tokens a reader may fall behind before its stream is ended
            (keep it under ``max_seq_len``, or it can never fire).
        max_inspect_tokens: Longest prompt ``/v1/inspect/attention`` accepts.
        settle_min_rows: After a decode step of at least this many rows, the engine lets
            the event loop write the step's tokens before it steps again (0: never waits).
        drain_grace_s: At shutdown, how long running requests may go on to their end before
            they are ended (new ones get 503 and ``/health`` 503 meanwhile, so a gateway
            sends them elsewhere); 0 ends them at once.
        drain_timeout_s: At shutdown, how long to wait for streams to send their last event.
        resume_window_s: How long a native stream with a ``request_id`` outlives its last
            reader (a reconnect within it resumes the stream).
        stored_responses: How many ``/v1/responses`` results are kept for a later
            ``previous_response_id`` (the oldest goes first).
        stored_response_ttl_s: How long a stored response can be continued.
        fim_layout: How a fill-in-the-middle prompt is laid out (``anchored``: the suffix
            stays cached while a person types; ``psm``: prefix, suffix, middle; ``spm``:
            suffix first), for ``/infill`` and ``suffix``.
        served_model_names: Names the model answers to (``--served-model-name``, repeatable;
            the first is the one responses carry and ``/v1/models`` lists first). Empty: the
            model's own name. With several models: more names of the default one.
        models: A model to serve, ``[NAME=]SOURCE`` (repeatable: requests pick one by its
            ``model``; the first is the default). SOURCE is ``default`` (the embedded
            SmolLM2-135M-Instruct), a packaged model (``qwen2.5-coder-0.5b``,
            ``all-minilm-l6-v2``...), a Hugging Face directory, a ``.gguf`` file or a hub id.
        models_file: A TOML file of models to serve, each with its settings (source,
            aliases, max_seq_len, kv_cache_gb, weights, draft_model, pinned, keep_alive).
        memory_budget_gb: Memory the loaded models may take together; loading one more
            unloads the least recently used idle ones that are not pinned (``None``: 75% of
            the machine's memory).
        keep_alive: How long a model stays loaded once idle (``5m``, ``1h``, seconds; ``-1``:
            for ever); a request's Ollama ``keep_alive`` overrides it, ``0`` unloads at once.
        engine: The engine's own configuration (batching, queue length), every model's
            unless its settings say otherwise.

    Raises:
        ValueError: A field is out of range; the message names the field.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    models_file: str = ""
    memory_budget_gb: float | None = None
    keep_alive: str = "5m"
    cors_origins: tuple[str, ...] = ()
    max_prompt_bytes: int | None = None
    max_body_bytes: int = 262144
    rate_limit: float | None = None
    rate_burst: int = 5
    heartbeat_s: float = 15.0
    max_timeout_s: float | None = 600.0
    output_buffer: int = 64
    max_pending_tokens: int = 1024
    max_inspect_tokens: int = 512
    settle_min_rows: int = 32
    drain_grace_s: float = 0.0
    drain_timeout_s: float = 10.0
    resume_window_s: float = 10.0
    stored_responses: int = 1024
    stored_response_ttl_s: float = 3600.0
    fim_layout: str = "anchored"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        self.api_keys = tuple(k for k in self.api_keys if k)
        self.cors_origins = tuple(o.rstrip("/") for o in self.cors_origins if o)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be >= 1, got {self.max_prompt_bytes}")
        for name in (
            "max_body_bytes",
            "rate_burst",
            "output_buffer",
            "max_pending_tokens",
            "max_inspect_tokens",
            "stored_responses",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heartbeat_s is None or not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        for name in ("rate_limit", "max_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.settle_min_rows < 0:
            raise ValueError(f"settle_min_rows must be >= 0, got {self.settle_min_rows}")
        if self.resume_window_s < 0:
            raise ValueError(f"resume_window_s must be >= 0, got {self.resume_window_s}")
        if not self.stored_response_ttl_s > 0:
            raise ValueError(f"stored_response_ttl_s must be > 0, got {self.stored_response_ttl_s}")
        if self.fim_layout not in FIM_LAYOUTS:
            raise ValueError(
                f"fim_layout must be one of {', '.join(FIM_LAYOUTS)}, got {self.fim_layout!r}"
            )
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb must be > 0, got {self.memory_budget_gb}")
        parse_keep_alive(self.keep_alive)  # raises for what is not a duration

    @property
    def keep_alive_s(self) -> float:
        """``keep_alive`` in seconds (``inf``: for ever)."""
        return parse_keep_alive(self.keep_alive)

    def model_specs(self) -> list[ModelSpec]:
        """The served models, the default first (see :mod:`infer.catalog`).

        Raises:
            ValueError: A malformed ``--model`` or models file, or a name given twice.
        """
        return model_specs(self.models, self.models_file, self.engine, self.served_model_names)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerConfig:
        """Build a config from ``INFER_*`` variables; unset ones keep their defaults.

        Server fields read ``INFER_<FIELD>`` (``INFER_PORT``, ``INFER_API_KEYS`` as a comma
        separated list, ...), engine fields the same way (``INFER_MODEL``, ``INFER_DTYPE``,
        ``INFER_BATCHING_MODE``, ...). ``none`` unsets an optional number.

        Args:
            environ: Variables to read (default: ``os.environ``).

        Returns:
            The config.

        Raises:
            ValueError: A variable does not parse or is out of range; the message names it.
        """
        env = os.environ if environ is None else environ
        server = _read_fields(cls, env, skip={"engine"})
        engine = _read_fields(EngineConfig, env, skip=set())
        return cls(**server, engine=EngineConfig(**engine))


def _read_fields(cls: type, env: Mapping[str, str], skip: set[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in fields(cls):
        name = f"INFER_{f.name.upper()}"
        if f.name in skip or name not in env:
            continue
        try:
            values[f.name] = _parser(f.default)(env[name].strip())
        except ValueError:
            raise ValueError(f"{name}: cannot parse {env[name]!r}") from None
    return values


def _parser(default: Any) -> Callable[[str], Any]:
    """How to parse a variable, judged by the field's default value."""
    if isinstance(default, tuple):
        return lambda s: tuple(p.strip() for p in s.split(",") if p.strip())
    if isinstance(default, bool):
        return _parse_bool
    if isinstance(default, int):
        return int
    if isinstance(default, float) or default is None:
        return _parse_optional_number
    return str


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _parse_optional_number(text: str) -> float | int | None:
    if text.lower() in ("", "none", "off"):
        return None
    number = float(text)
    return int(number) if number.is_integer() and "." not in text else number
