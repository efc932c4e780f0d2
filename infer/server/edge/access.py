"""Who may call and how much: API keys, a per-client rate limit, CORS.

A route's dialect (:class:`~infer.server.edge.errors.Dialect`) says which header carries
its callers' key; refusals are answered in that dialect too.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable, Sequence

from quart import Quart, Response, request

from infer.api.errors import APIError, ErrorCode
from infer.server import playground
from infer.server.config import ServerConfig
from infer.server.edge.errors import Dialect, dialect, error_response

OPEN_PATHS = frozenset({"/health"})  # and the pages (playground.is_open)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, Last-Event-ID"
CORS_MAX_AGE = "600"


class ApiKeys:
    """Bearer tokens checked in constant time.

    Every configured key is compared (no early exit), on SHA-256 digests so that neither the
    position of the first differing byte nor the key lengths leak through timing.

    Args:
        keys: Accepted tokens; none disables the check.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None, bearer: bool = True) -> None:
        """Accept an ``Authorization`` header value (``bearer``), or a header that holds
        the key alone.

        Raises:
            APIError: 401, the token is missing or wrong.
        """
        if not self.enabled:
            return
        value = authorization or ""
        scheme, _, token = value.partition(" ") if bearer else ("bearer", "", value)
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for expected in self._digests:
            ok |= hmac.compare_digest(digest, expected)
        if scheme.lower() != "bearer" or not ok:
            raise APIError(ErrorCode.INVALID_API_KEY, headers={"WWW-Authenticate": "Bearer"})


class RateLimiter:
    """A token bucket per client: ``burst`` requests at once, refilled at ``per_minute``.

    Args:
        per_minute: Sustained requests per minute.
        burst: Bucket size.
        clock: Monotonic seconds (tests may pass their own).
        max_clients: Buckets kept before idle (full) ones are dropped.
    """

    def __init__(
        self,
        per_minute: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10000,
    ) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self._clock = clock
        self._max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # key → (tokens, updated)

    def acquire(self, key: str) -> None:
        """Take one request from ``key``'s bucket.

        Raises:
            APIError: 429 with ``Retry-After`` (whole seconds) when the bucket is empty.
        """
        now = self._clock()
        tokens = self._level(key, now)
        if tokens < 1.0:
            retry = max(1, math.ceil((1.0 - tokens) / self.rate))
            raise APIError(
                ErrorCode.RATE_LIMITED,
                f"rate limit exceeded; retry in {retry} s",
                {"Retry-After": str(retry)},
            )
        if key not in self._buckets and len(self._buckets) >= self._max_clients:
            self._prune(now)
        self._buckets[key] = (tokens - 1.0, now)

    def _level(self, key: str, now: float) -> float:
        tokens, updated = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - updated) * self.rate)

    def _prune(self, now: float) -> None:
        full = [k for k in self._buckets if self._level(k, now) >= self.burst]
        for k in full:
            del self._buckets[k]


def client_key(authorization: str | None, remote_addr: str | None) -> str:
    """What the rate limit counts by: the bearer token if there is one, else the address."""
    if authorization:
        return "key:" + hashlib.sha256(authorization.encode()).hexdigest()
    return "addr:" + (remote_addr or "unknown")


def install(app: Quart, config: ServerConfig) -> None:
    """Register CORS, authentication and rate limiting on every request of ``app``."""
    keys = ApiKeys(config.api_keys)
    limiter = RateLimiter(config.rate_limit, config.rate_burst) if config.rate_limit else None
    origins = frozenset(config.cors_origins)

    @app.before_request
    async def _guard() -> Response | None:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return _preflight(origins)
        if request.path in OPEN_PATHS or (
            request.method == "GET" and playground.is_open(request.path)
        ):
            return None
        key, bearer = _credential(dialect())
        try:
            keys.check(key, bearer)
            if limiter is not None and request.method == "POST":
                # Only a checked key identifies a client; any other header is free to vary.
                token = key if keys.enabled else None
                limiter.acquire(client_key(token, request.remote_addr))
        except APIError as e:
            return error_response(e)
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and _allowed(origin, origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
            response.vary.add("Origin")
        return response


def _credential(speaks: Dialect) -> tuple[str | None, bool]:
    """The caller's key and whether it comes as ``Bearer <key>``: in its dialect's header,
    else in ``Authorization`` (an Anthropic client given a token sends it there)."""
    key = request.headers.get(speaks.key_header)
    if key is None and speaks.key_header.lower() != "authorization":
        return request.headers.get("Authorization"), True
    return key, speaks.bearer


def _allowed(origin: str, origins: frozenset[str]) -> bool:
    return "*" in origins or origin.rstrip("/") in origins


def _preflight(origins: frozenset[str]) -> Response:
    origin = request.headers.get("Origin", "")
    if not _allowed(origin, origins):
        return error_response(
            APIError(ErrorCode.ORIGIN_NOT_ALLOWED, f"origin {origin!r} is not allowed")
        )
    response = Response("", status=204)
    response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
    response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
    response.headers["Access-Control-Max-Age"] = CORS_MAX_AGE
    return response
