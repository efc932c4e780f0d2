"""llama.cpp's code completion, ``/infill`` (:mod:`infer.api.infill`): parse, admit, hand the
stream to its writer; errors in llama.cpp's shape."""

from __future__ import annotations

from functools import partial

import trio
from quart import Blueprint, Response

from infer.api.fim import Layout
from infer.api.infill.bodies import InfillError, InfillResponse, error_body
from infer.api.infill.models import InfillRequest
from infer.api.infill.writer import InfillWriter
from infer.server.edge.errors import Dialect
from infer.server.edge.exchange import answer, parse_body
from infer.server.edge.openapi import documented
from infer.server.host.state import get_state

blueprint = Blueprint("infill", __name__)
DIALECT = Dialect(error_body=error_body, error_type=InfillError)


@blueprint.post("/infill")
@documented("code completion", InfillRequest, InfillResponse, dialect=DIALECT)
async def infill() -> Response:
    """Fill in the middle: the code before and after the cursor, and other files."""
    arrival = trio.current_time()
    body = await parse_body(InfillRequest)
    state = get_state()
    request = body.engine_request(Layout(state.config.fim_layout))
    return await answer(request, arrival, partial(InfillWriter, body, clock=trio.current_time))
