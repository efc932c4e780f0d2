"""How errors are answered: in the shape of the protocol the caller speaks.

The codes are one table (:class:`~infer.api.errors.ErrorCode`); each protocol supplies its
error body (OpenAI's ``{"error": {"message", "type", "code"}}``, which infer's own routes
share) as a :class:`Dialect`, registered with the routes that speak it. An error raised
while handling a request, a refusal at the edge (a key, a rate, a body size) included, is
answered in the dialect of the route it was for; no traceback ever reaches a client: an
unexpected exception is logged and answered with a generic 500.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from quart import Quart, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from infer.api.errors import APIError, ErrorCode, ErrorResponse, error_body

log = logging.getLogger("infer.server")

_DIALECTS = "infer.dialects"


@dataclass(frozen=True)
class Dialect:
    """What one protocol's callers expect of the edge.

    Args:
        error_body: The body of an error answer.
        error_type: Its type, as ``/openapi.json`` documents it.
        key_header: The header that carries the API key.
        bearer: The key comes as ``Bearer <key>`` (else as the header's whole value).
    """

    error_body: Callable[[APIError], Mapping[str, Any]] = error_body
    error_type: Any = ErrorResponse
    key_header: str = "Authorization"
    bearer: bool = True


DEFAULT = Dialect()

# The codes of the HTTP errors Quart raises itself (routing, body size, timeouts).
_HTTP_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    408: ErrorCode.REQUEST_TIMEOUT,
    413: ErrorCode.BODY_TOO_LARGE,
}


def dialect() -> Dialect:
    """The dialect of the route the current request is for (the default before routing)."""
    dialects: Mapping[str, Dialect] = current_app.extensions.get(_DIALECTS, {})
    return dialects.get(request.blueprint or "", DEFAULT)


def error_response(error: APIError) -> Response:
    """The answer to ``error`` in the current request's dialect."""
    response = jsonify(dialect().error_body(error))
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


def install(app: Quart, dialects: Mapping[str, Dialect]) -> None:
    """Answer every error raised while handling a request in its route's dialect.

    Args:
        app: The app.
        dialects: Each blueprint's dialect, by name (others speak :data:`DEFAULT`).
    """
    app.extensions[_DIALECTS] = dict(dialects)

    @app.errorhandler(APIError)
    async def _api_error(error: APIError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = _HTTP_CODES.get(status, ErrorCode.INVALID_REQUEST)
        message = (
            code.message
            if code is not ErrorCode.INVALID_REQUEST
            else (error.description or error.name)
        )
        allowed = getattr(error, "valid_methods", None)
        headers = {"Allow": ", ".join(allowed)} if status == 405 and allowed else None
        return error_response(APIError(code, message, headers, status=status))

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("unhandled error", exc_info=error)
        return error_response(APIError(ErrorCode.INTERNAL_ERROR))
