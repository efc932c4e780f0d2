"""Errors before a stream starts: one JSON shape, ``{"error": {"message", "type", "code"}}``.

Every failure a client can see is an :class:`~infer.engine.request.ErrorCode` (its status,
retryability and message are defined there) and goes through here, so no traceback ever
reaches a client: an unexpected exception is logged and answered with a generic 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from quart import Quart, Response, jsonify
from werkzeug.exceptions import HTTPException

from infer.engine.request import ErrorCode

log = logging.getLogger("infer.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
RETRY_AFTER_S = "1"  # what a retryable 503 asks a client to wait

# The codes of the HTTP errors Quart raises itself (routing, body size, timeouts).
_HTTP_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    408: ErrorCode.REQUEST_TIMEOUT,
    413: ErrorCode.BODY_TOO_LARGE,
}


class APIError(Exception):
    """An error answered as JSON with a stable code.

    Args:
        code: What went wrong; it gives the status, and the message unless one is given.
        message: A more specific message, for people (never an exception's own text).
        headers: Extra response headers (``Retry-After`` for a retryable 503 is added).
        status: Only for HTTP errors that no code names (a malformed request line).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str | None = None,
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message or code.message)
        self.code = code
        self.message = message or code.message
        self.status = status or code.status
        self.headers = dict(headers or {})
        if code.retryable and self.status == 503:
            self.headers.setdefault("Retry-After", RETRY_AFTER_S)

    @property
    def type(self) -> str:
        default = "server_error" if self.status >= 500 else "invalid_request_error"
        return ERROR_TYPES.get(self.status, default)

    def body(self) -> dict[str, Any]:
        """The error object every JSON error (and OpenAI stream error chunk) carries."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code.value}}


def error_response(error: APIError) -> Response:
    """The JSON response for an :class:`APIError`."""
    response = jsonify(error.body())
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


def register_error_handlers(app: Quart) -> None:
    """Answer every error raised while handling a request with the JSON error shape."""

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
