"""Ollama's API (:mod:`infer.api.ollama`): every served model's card, loading a model on
demand, and replies in NDJSON lines; errors in Ollama's shape. (``HEAD /``, Ollama's
heartbeat, is the playground's page.)"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from functools import partial
from weakref import WeakKeyDictionary

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
from infer.server.host.admission import generating
from infer.server.host.embedding import Embedded
from infer.server.host.embedding import embed as embed_inputs
from infer.server.host.registry import ModelSlot
from infer.server.host.state import counting_refusals, get_state

blueprint = Blueprint("ollama", __name__)
DIALECT = Dialect(error_body=b.error_body, error_type=b.OllamaError)
in_docs = partial(documented, "Ollama", dialect=DIALECT)
named = partial(in_docs, statuses=(404,))  # a route that names a model: 404 for another
_CARDS: WeakKeyDictionary[ModelSlot, ModelCard] = WeakKeyDictionary()  # each one's, once loaded


def _slot(model: str) -> ModelSlot:
    """The served model a client's ``model`` names (``name:latest`` too); 404 for another."""
    state = get_state()
    if (name := m.served_name(model, state.serves)) is None:
        raise b.not_found(model)
    return state.models.resolve(name)


def _card(slot: ModelSlot) -> ModelCard:
    """Its card: from its engine or embedder while loaded, else the last one it had."""
    if slot.engine is not None:
        card = ModelCard.of(slot.engine, slot.names, get_state().config.fim_layout)
    elif slot.embedder is not None:
        card = ModelCard.of_embedder(
            slot.embedder.embedder, slot.names, slot.spec.engine, slot.size
        )
    else:
        return _CARDS.get(slot) or ModelCard.unloaded(slot.names, slot.spec.engine, slot.size)
    _CARDS[slot] = card
    return card


def _running(slot: ModelSlot) -> ModelCard:
    """Its card, with when its keep-alive ends (one in use: that long after now)."""
    left = slot.keep_alive_s if slot.busy else slot.expires_at - trio.current_time()
    expires = math.inf if slot.pinned else time.time() + left
    return dataclasses.replace(_card(slot), expires_at=expires)


async def _reply(model: type[m.ReplyFields], writer: Callable[..., Writer], chat: bool) -> Response:
    arrival = trio.current_time()
    body = await parse_body(model)
    state, slot = get_state(), _slot(body.model)
    if body.loads_only() and body.unloads():
        state.require_open()
        await state.models.unload(slot.name)
        return jsonify(b.loaded(body.model, True, chat))
    with (
        counting_refusals(state, slot.name),
        b.refusing(body.model, "chat" if chat else "generate"),
    ):
        waited = trio.current_time()
        async with generating(state, slot.name, body.keep_alive_s()) as (slot, engine, _):
            load_s = trio.current_time() - waited
            card = ModelCard.of(engine, slot.names, state.config.fim_layout)
            request = None if body.loads_only() else body.engine_request(card)
    if request is None:
        return jsonify(b.loaded(body.model, False, chat))
    reply = partial(writer, body, clock=trio.current_time, load_s=load_s)
    return await answer(request, arrival, reply, NDJSON)


async def _embed(body: m.Embeddable, truncate: bool, dimensions: int | None = None) -> Embedded:
    with b.refusing(body.model, "embeddings"):
        name, keep_alive = _slot(body.model).name, body.keep_alive_s()
        inputs = body.inputs()
        return await embed_inputs(get_state(), name, inputs, truncate, dimensions, keep_alive, True)


@blueprint.get("/api/version")
@in_docs(response=b.OllamaVersion)
async def version() -> Response:
    """The Ollama release whose API these routes follow."""
    return jsonify(b.version())


@blueprint.get("/api/tags")
@in_docs(response=b.OllamaListResponse)
async def tags() -> Response:
    """Every served model under each of its names, loaded or not."""
    return jsonify(b.model_list(*map(_card, get_state().models.slots)))


@blueprint.get("/api/ps")
@in_docs(response=b.OllamaProcessResponse)
async def ps() -> Response:
    """The loaded models, and when each one's keep-alive ends."""
    loaded = [s for s in get_state().models.slots if s.loaded]
    return jsonify(b.running(*map(_running, loaded)))


@blueprint.post("/api/show")
@named(m.OllamaShowRequest, b.OllamaShowResponse)
async def show() -> Response:
    """The model's template, parameters, sizes and capabilities (loaded to know them)."""
    slot = _slot((await parse_body(m.OllamaShowRequest)).model_name())
    if slot.loaded or slot in _CARDS:
        return jsonify(b.show(_card(slot)))
    async with get_state().models.use(slot.name) as slot:
        return jsonify(b.show(_card(slot)))


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
    """A vector per `input` (a text or a list), from an embedding model."""
    arrival = trio.current_time()
    body = await parse_body(m.OllamaEmbedRequest)
    done = await _embed(body, body.truncate, body.dimensions)
    spent = trio.current_time() - arrival
    vectors, tokens = done.embeddings.vectors, done.embeddings.total_tokens
    return jsonify(b.embedded(body.model, vectors, tokens, spent, done.load_s))


@blueprint.post("/api/embeddings")
@named(m.OllamaEmbeddingsRequest, b.OllamaEmbeddingResponse)
async def embeddings() -> Response:
    """The vector of `prompt` (Ollama's older route), as `/api/embed`."""
    body = await parse_body(m.OllamaEmbeddingsRequest)
    return jsonify(b.embedding((await _embed(body, truncate=True)).embeddings.vectors))


@blueprint.route("/api/<any(pull, push, create, copy, delete):action>", methods=["POST", "DELETE"])
@in_docs()
async def manage(action: str) -> Response:
    """Managing models: not here (the server serves the models it was started with)."""
    raise b.cannot_manage(action)
