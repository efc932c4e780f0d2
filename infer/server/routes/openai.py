"""OpenAI's completions and chat completions, and the model list: parse with the protocol's
model, admit, hand the stream to its writer (:mod:`infer.api.openai`)."""

from __future__ import annotations

from functools import partial

import trio
from quart import Blueprint, Response, jsonify

from infer.api.fim import Layout
from infer.api.openai.bodies import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
    ServedModel,
    model_list,
)
from infer.api.openai.models import ChatCompletionRequest, CompletionRequest
from infer.api.openai.writer import chat_writer, completion_writer
from infer.server.edge.exchange import answer, parse_body
from infer.server.edge.openapi import documented
from infer.server.host.state import get_state

blueprint = Blueprint("openai", __name__)


@blueprint.get("/v1/models")
@documented("OpenAI", response=ModelList)
async def models() -> Response:
    """Every served model under each of its names, with its context length and status."""
    slots = get_state().models.slots
    return jsonify(model_list([ServedModel(s.names, s.max_model_len, s.status) for s in slots]))


@blueprint.post("/v1/completions")
@documented("OpenAI", CompletionRequest, CompletionResponse)
async def completions() -> Response:
    """Text completions of `prompt` (one or a list), `n` per prompt."""
    arrival = trio.current_time()
    body = await parse_body(CompletionRequest)
    layout = Layout(get_state().config.fim_layout)  # a `suffix` fills in the middle
    return await answer(body.engine_request(layout), arrival, partial(completion_writer, body))


@blueprint.post("/v1/chat/completions")
@documented("OpenAI", ChatCompletionRequest, ChatCompletionResponse)
async def chat_completions() -> Response:
    """`n` assistant replies to `messages`, through the model's chat template."""
    arrival = trio.current_time()
    body = await parse_body(ChatCompletionRequest)
    return await answer(body.engine_request(), arrival, partial(chat_writer, body))
