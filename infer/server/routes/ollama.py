"""Ollama's API (:mod:`infer.api.ollama`): the model's card, and replies in NDJSON lines;
errors in Ollama's shape. (``HEAD /``, Ollama's heartbeat, is the playground's page.)"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import trio
from quart import Blueprint, Response, jsonify

from infer.api.ollama import bodies as b
from infer.api.ollama import models as m
from infer.api.ollama.card import ModelCard
from infer.api.ollama.writer import chat_writer, generate_writer
from infer.api.writer import Writer
from infer.server.edge.errors import Dialect
from infer.server.edge.exchange import answer, parse_body
from infer.server.edge.framing import NDJSON
from infer.server.edge.openapi import documented
from infer.server.host.state import get_state

blueprint = Blueprint("ollama", __name__)
DIALECT = Dialect(error_body=b.error_body, error_type=b.OllamaError)
in_docs = partial(documented, "Ollama", dialect=DIALECT)
named = partial(in_docs, statuses=(404,))  # a route that names a model: 404 for another


def _card(model: str | None = None) -> ModelCard:
    """The served model's card; 404 for a ``model`` it is not."""
    state = get_state()
    if model is not None and not any(map(state.serves, m.model_names(model))):
        raise b.not_found(model)
    return ModelCard.of(state.require_ready()[0], state.model_names, state.config.fim_layout)


async def _reply(model: type[m.ReplyFields], writer: Callable[..., Writer], chat: bool) -> Response:
    arrival = trio.current_time()
    body = await parse_body(model)
    card = _card(body.model)
    if body.loads_only():
        return jsonify(b.loaded(body.model, body.unloads(), chat))
    reply = partial(writer, body, clock=trio.current_time)
    return await answer(body.engine_request(card), arrival, reply, NDJSON)


@blueprint.get("/api/version")
@in_docs(response=b.OllamaVersion)
async def version() -> Response:
    """The Ollama release whose API these routes follow."""
    return jsonify(b.version())


@blueprint.get("/api/tags")
@in_docs(response=b.OllamaListResponse)
async def tags() -> Response:
    """The served model, under each of its names."""
    return jsonify(b.model_list(_card()))


@blueprint.get("/api/ps")
@in_docs(response=b.OllamaProcessResponse)
async def ps() -> Response:
    """The loaded model (loaded for the server's life)."""
    return jsonify(b.running(_card()))


@blueprint.post("/api/show")
@named(m.OllamaShowRequest, b.OllamaShowResponse)
async def show() -> Response:
    """The model's template, parameters, sizes and capabilities."""
    return jsonify(b.show(_card((await parse_body(m.OllamaShowRequest)).model_name())))


@blueprint.post("/api/generate")
@named(m.OllamaGenerateRequest, b.OllamaGenerateResponse)
async def generate() -> Response:
    """A completion of `prompt`, or the code between `prompt` and `suffix` (NDJSON lines)."""
    return await _reply(m.OllamaGenerateRequest, generate_writer, chat=False)


@blueprint.post("/api/chat")
@named(m.OllamaChatRequest, b.OllamaChatResponse)
async def chat() -> Response:
    """The assistant's next message, its thinking and tool calls (NDJSON lines)."""
    return await _reply(m.OllamaChatRequest, chat_writer, chat=True)


@blueprint.post("/api/embed")
@named(m.OllamaEmbedRequest, b.OllamaEmbedResponse)
async def embed() -> Response:
    """Vectors of `input`, from a model that embeds (the served one does not)."""
    body = await parse_body(m.OllamaEmbedRequest)
    raise b.cannot_embed(_card(body.model), body.model)


@blueprint.post("/api/embeddings")
@named(m.OllamaEmbeddingsRequest, b.OllamaEmbeddingResponse)
async def embeddings() -> Response:
    """The vector of `prompt` (Ollama's older route), as `/api/embed`."""
    body = await parse_body(m.OllamaEmbeddingsRequest)
    raise b.cannot_embed(_card(body.model), body.model)


@blueprint.route("/api/<any(pull, push, create, copy, delete):action>", methods=["POST", "DELETE"])
@in_docs()
async def manage(action: str) -> Response:
    """Managing models: not here (the server serves the model it was started with)."""
    raise b.cannot_manage(action)
