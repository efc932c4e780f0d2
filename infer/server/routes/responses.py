"""OpenAI's Responses API (:mod:`infer.api.responses`): the input after the stored
conversation ``previous_response_id`` names, one reply, stored for a later request."""

from __future__ import annotations

from functools import partial

import trio
from quart import Blueprint, Response

from infer.api.responses.bodies import ResponseObject
from infer.api.responses.models import ResponsesRequest
from infer.api.responses.writer import responses_writer
from infer.server.edge.exchange import answer, parse_body
from infer.server.edge.openapi import documented
from infer.server.host.state import counting_refusals, get_state

blueprint = Blueprint("responses", __name__)


@blueprint.post("/v1/responses")
@documented("OpenAI", ResponsesRequest, ResponseObject, statuses=(404,))
async def create_response() -> Response:
    """One assistant reply to `input`, as a Responses object or its event stream."""
    arrival = trio.current_time()
    body = await parse_body(ResponsesRequest)
    state = get_state()
    with counting_refusals(state):
        conversation = body.conversation(state.responses.get)
    writer = partial(responses_writer, body, conversation=conversation, store=state.responses.put)
    return await answer(body.engine_request(conversation), arrival, writer)
