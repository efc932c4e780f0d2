"""Anthropic's Messages API (:mod:`infer.api.anthropic`): parse, admit, hand the stream to its
writer; errors in Anthropic's shape and statuses, keys in ``x-api-key`` (or ``Authorization:
Bearer``), ``ping`` events as the heartbeat. ``anthropic-version``, ``anthropic-beta`` and
``?beta=true`` change nothing."""

from __future__ import annotations

from functools import partial

import trio
from quart import Blueprint, Response, jsonify

from infer.api.anthropic import bodies
from infer.api.anthropic.models import CountTokensRequest, MessagesRequest
from infer.api.anthropic.writer import messages_writer
from infer.api.writer import Event
from infer.server.edge.errors import Dialect
from infer.server.edge.exchange import answer, parse_body
from infer.server.edge.framing import sse_with_heartbeat
from infer.server.edge.openapi import documented
from infer.server.host.admission import encode, generating, tool_plan
from infer.server.host.state import get_state

blueprint = Blueprint("anthropic", __name__)
DIALECT = Dialect(bodies.error_body, bodies.AnthropicError, key_header="x-api-key", bearer=False)
FRAMING = sse_with_heartbeat(Event(bodies.PING, "ping"))


@blueprint.post("/v1/messages")
@documented("Anthropic", MessagesRequest, bodies.AnthropicMessage, dialect=DIALECT, statuses=(404,))
async def create_message() -> Response:
    """One assistant reply to `messages`, as a message or its event stream."""
    arrival = trio.current_time()
    with bodies.statuses():
        body = await parse_body(MessagesRequest)
        writer = partial(messages_writer, body)
        return await answer(body.engine_request(), arrival, writer, FRAMING)


@blueprint.post("/v1/messages/count_tokens")
@documented(
    "Anthropic", CountTokensRequest, bodies.AnthropicTokenCount, dialect=DIALECT, statuses=(404,)
)
async def count_tokens() -> Response:
    """The tokens these `messages` would take on `model` (template and tools included)."""
    with bodies.statuses():
        body = await parse_body(CountTokensRequest)
        state = get_state()
        async with generating(state, body.model) as (_, engine, _):
            plan = tool_plan(engine, body.offered_tools())
            [ids] = await encode(state, engine, [body.prompt()], plan)
    return jsonify(bodies.AnthropicTokenCount(input_tokens=len(ids)))
