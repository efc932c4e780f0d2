"""Errors before a stream starts: one JSON shape, ``{"error": {"message", "type", "code"}}``.

Every failure a client can see goes through here, so no traceback ever reaches it: an
unexpected exception is logged and answered with a generic 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from quart import Quart, Response, jsonify
from werkzeug.exceptions import HTTPException

log = logging.getLogger("infer.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
}

# Codes for the HTTP errors Quart raises itself (routing, body size, malformed requests).
_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
}


class APIError(Exception):
    """An error answered as JSON with a stable ``code``.

    Args:
        status: HTTP status.
        message: What went wrong, for people.
        code: Stable machine-readable code (``queue_full``, ``prompt_too_large``, ...).
        headers: Extra response headers (``Retry-After``).
    """

    def __init__(
        self, status: int, message: str, code: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else
                               "invalid_request_error")


def error_body(message: str, type_: str, code: str) -> dict[str, Any]:
    """The error object every JSON error (and OpenAI stream error chunk) carries."""
    return {"error": {"message": message, "type": type_, "code": code}}


def error_response(error: APIError) -> Response:
    """The JSON response for an :class:`APIError`."""
    response = jsonify(error_body(error.message, error.type, error.code))
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
        code = _HTTP_CODES.get(status, f"http_{status}")
        message = error.description or error.name
        if status == 413:
            message = "the request body is too large"
        allowed = getattr(error, "valid_methods", None)
        headers = {"Allow": ", ".join(allowed)} if status == 405 and allowed else None
        return error_response(APIError(status, message, code, headers))

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("unhandled error", exc_info=error)
        return error_response(APIError(500, "internal server error", "internal_error"))
