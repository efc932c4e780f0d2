"""The Quart-Trio application: ``create_app()`` builds it, :mod:`infer.server.serve` serves it.

The engine loop starts when serving starts, in ``app.nursery`` under its own cancel scope
(see :mod:`infer.server.host.state`). At shutdown the server calls :func:`drain` before it closes
any connection: new requests are refused, running ones end ``CANCELLED``, and every open
stream sends its terminal event.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from quart_trio import QuartTrio

from infer import __version__
from infer.engine.embed import Embedder
from infer.engine.engine import Engine
from infer.server import playground
from infer.server.config import ServerConfig
from infer.server.edge import access, errors, openapi
from infer.server.edge.guard import RequestGuard
from infer.server.host.state import ServerState
from infer.server.routes import anthropic, embeddings, infill, native, ollama, ops, responses
from infer.server.routes import openai as openai_routes

# The routes, each blueprint with the dialect its errors are answered in.
ROUTES = (
    (openai_routes.blueprint, errors.DEFAULT),
    (responses.blueprint, errors.DEFAULT),
    (embeddings.blueprint, errors.DEFAULT),
    (native.blueprint, errors.DEFAULT),
    (infill.blueprint, infill.DIALECT),
    (ollama.blueprint, ollama.DIALECT),
    (anthropic.blueprint, anthropic.DIALECT),
    (ops.blueprint, errors.DEFAULT),
    (playground.blueprint, errors.DEFAULT),
)


def create_app(
    config: ServerConfig | None = None, engine: Engine | Embedder | None = None
) -> QuartTrio:
    """Build the application; an app object serves once (build a new one per server).

    Args:
        config: Server settings (default: from ``INFER_*`` environment variables).
        engine: The default model, loaded (an engine, or an embedder); ``None`` loads it in
            the background once serving starts (``/health`` answers 503 until it is
            ready). Other models of ``config`` load when a request names them.

    Returns:
        The app.

    Raises:
        ValueError: An ``INFER_*`` variable, a ``--model`` or the models file is invalid.
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
    errors.install(app, {blueprint.name: dialect for blueprint, dialect in ROUTES})
    access.install(app, config)
    for blueprint, _ in ROUTES:
        app.register_blueprint(blueprint)
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
