"""The Quart-Trio application: ``create_app()`` builds it, :mod:`infer.server.serve` serves it.

The engine loop starts when serving starts, in ``app.nursery`` under its own cancel scope
(see :mod:`infer.server.state`). At shutdown the server calls :func:`drain` before it closes
any connection: new requests are refused, running ones end ``CANCELLED``, and every open
stream sends its terminal event.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from quart import Response, jsonify
from quart_trio import QuartTrio

from infer import __version__
from infer.engine.engine import Engine
from infer.server import limits, native_routes, openai_routes, openapi, pages
from infer.server.asgi import RequestGuard
from infer.server.config import ServerConfig
from infer.server.errors import register_error_handlers
from infer.server.metrics import CONTENT_TYPE
from infer.server.schemas import MAX_CHOICES, MAX_LOGPROBS
from infer.server.state import ServerState, get_state


def create_app(config: ServerConfig | None = None, engine: Engine | None = None) -> QuartTrio:
    """Build the application; an app object serves once (build a new one per server).

    Args:
        config: Server settings (default: from ``INFER_*`` environment variables).
        engine: A loaded engine to serve; ``None`` loads ``config.engine`` in the background
            once serving starts (``/health`` answers 503 until it is ready).

    Returns:
        The app.

    Raises:
        ValueError: An ``INFER_*`` variable is invalid.
    """
    config = config if config is not None else ServerConfig.from_env()
    app = QuartTrio("infer.server")
    app.config.update(
        RESPONSE_TIMEOUT=None,  # Quart's 60 s default would cut long streams silently
        MAX_CONTENT_LENGTH=config.max_body_bytes,
    )
    app.asgi_app = RequestGuard(app.asgi_app)  # type: ignore[method-assign,assignment]
    state = ServerState(config, engine)
    app.extensions["infer"] = state
    register_error_handlers(app)
    limits.install(app, config)
    app.register_blueprint(openai_routes.blueprint)
    app.register_blueprint(native_routes.blueprint)
    app.register_blueprint(pages.blueprint)
    app.add_url_rule("/health", "health", _health, methods=["GET"])
    app.add_url_rule("/metrics", "metrics", _metrics, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_url_rule(path, "model_info", _model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_url_rule(path, "server_info", _server_info, methods=["GET"])
    openapi.install(app, __version__)

    @app.while_serving
    async def _engine_lifetime() -> AsyncGenerator[None, None]:
        await app.nursery.start(state.run_engine)
        yield
        await state.stop()

    return app


async def drain(app: QuartTrio, timeout_s: float | None = None) -> None:
    """End every open request of ``app`` with a terminal event and wait for its stream.

    Args:
        app: An app from :func:`create_app`, while it serves.
        timeout_s: Longest to wait (default: the config's ``drain_timeout_s``).
    """
    state: ServerState = app.extensions["infer"]
    await state.drain(timeout_s)


async def _health() -> tuple[Response, int]:
    """Readiness: 200 once the model is loaded and the engine loop runs, else 503."""
    state = get_state()
    worker = state.worker
    body = {
        "status": state.status.value,
        "model": state.model_name,
        "running": worker.running if worker else 0,
        "waiting": worker.waiting if worker else 0,
    }
    return jsonify(body), 200 if state.ready else 503


async def _metrics() -> Response:
    """Prometheus text exposition."""
    state = get_state()
    worker = state.worker
    text = state.metrics.render(
        running=worker.running if worker else 0,
        waiting=worker.waiting if worker else 0,
        ready=state.ready,
        cache=state.engine.cache_stats() if state.engine is not None else None,
    )
    return Response(text, status=200, content_type=CONTENT_TYPE)


# What SGLang Model Gateway asks of a worker.


async def _model_info() -> Response:
    """The model, in SGLang's shape (the gateway names its workers' model from it)."""
    state = get_state()
    engine, _ = state.require_ready()
    config = engine.model.config
    return jsonify(
        {
            "model_path": state.config.engine.model,
            "tokenizer_path": state.config.engine.model,
            "served_model_name": state.model_name,
            "is_generation": True,
            "supports_vision": False,
            "model_type": config.architecture,
            "architectures": [config.architecture],
            "max_context_length": engine.max_seq_len,
            "max_req_input_len": engine.max_seq_len - 1,
            "vocab_size": config.vocab_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "weight_version": "default",
        }
    )


async def _server_info() -> Response:
    """The server's limits and version, in SGLang's shape."""
    state = get_state()
    engine, _ = state.require_ready()
    return jsonify(
        {
            "model_path": state.config.engine.model,
            "tokenizer_path": state.config.engine.model,
            "served_model_name": state.model_name,
            "served_model_names": list(state.model_names),
            "context_length": engine.max_seq_len,
            "max_running_requests": engine.config.max_batch_size,
            "max_total_num_tokens": engine.blocks.num_blocks * engine.config.block_size,
            "page_size": engine.config.block_size,
            "dtype": engine.config.dtype,
            "max_inspect_tokens": state.config.max_inspect_tokens,
            "max_logprobs": MAX_LOGPROBS,
            "max_choices": MAX_CHOICES,
            "version": __version__,
            "backend": "infer",
        }
    )
