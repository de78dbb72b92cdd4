"""The OpenAI port's doors: every check a request passes before the frontend does work for it.

In order, each refusal an OpenAI-shaped error with its status, before the body is read:

1. API key (``auth``: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``), when keys are configured: ``/live`` stays open for liveness probes;
   ``/health`` answers an unauthenticated caller with its status only (no models, workers,
   addresses or pids); ``/metrics`` also takes the cluster token (``member_token``), so the
   cluster's own readers (Prometheus, the console, the planner) need no API key; every other route
   answers 401. Without keys the port is open by the operator's choice, ``/metrics`` included.
   Failed checks (a wrong key, or none where one is needed) are counted per client address on
   every route, ``/health`` and ``/metrics`` included (``--auth-failure-rate``/``-burst``): past
   them, that address gets 429 with ``Retry-After`` for any request that presents a key or needs
   one, *before* the key is checked, so a guess made while refused tells nothing. ``/live`` and
   the key-less status of ``/health`` stay open to it.
2. Rate (``limits.RateLimiter``), when ``--rate-limit`` is set: per API key, else per client
   address, on the API routes (probes and scrapes are not counted); 429 with ``Retry-After``.
   Callers with a wrong key are counted by address, so guessing keys is rate-limited too.
3. Body size: a declared ``Content-Length`` over ``--max-body-bytes`` is a 413 (and the connection
   is closed rather than the rest of the body read); a chunked body is cut off as it passes it.
4. Admission on the generation routes: while draining or at ``--max-inflight``, a 503 before the
   body is read (the endpoints check again once they have it).

With nothing configured (loopback default) this is a dictionary lookup, a scan of the headers for
``Content-Length`` and two comparisons per request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from dynamod.daemon.frontend.http.asgi import Scope, send_error
from dynamod.daemon.frontend.http.auth import ApiKeys, presented_key
from dynamod.daemon.frontend.http.errors import HttpError, to_http_error
from dynamod.daemon.frontend.http.limits import (
    DEFAULT_AUTH_FAILURE_BURST,
    DEFAULT_AUTH_FAILURE_RATE,
    DEFAULT_MAX_BODY_BYTES,
    RATE_LIMIT_SCOPE_KEY,
    RateLimiter,
    capped_receive,
    declared_length,
    rate_limited_error,
    too_large,
)
from dynamod.daemon.frontend.http.request_id import assign as assign_request_id
from dynamod.daemon.frontend.http.request_id import echoing_send
from dynamod.shared.errors import (
    DynamoError,
    InvalidApiKeyError,
    InvalidRequestError,
    RateLimitedError,
)
from dynamod.shared.security.token import ClusterToken

HEALTH_DETAILS = "dynamod.health_details"
"""Scope key: False when ``/health`` must answer without instance details (unauthenticated)."""

OPEN_PATHS = frozenset({"/live"})
METRICS_PATH = "/metrics"
TRACES_PATH = "/v1/traces"
MEMBER_PATHS = frozenset({METRICS_PATH, TRACES_PATH})  # the cluster token opens these like an API key
MEMBER_CLIENT = "cluster-member"  # the client name of a /metrics caller holding the cluster token
NOT_RATE_LIMITED = frozenset({"/live", "/health", "/metrics", TRACES_PATH})

REASON_UNAUTHENTICATED = "unauthenticated"
REASON_AUTH_RATE_LIMITED = "auth_rate_limited"
REASON_RATE_LIMITED = "rate_limited"
REASON_BODY_TOO_LARGE = "body_too_large"
REASON_OVERLOADED = "overloaded"  # at --max-inflight (also pipeline/state.py's admission refusal)
REASON_DRAINING = "draining"  # shutting down
REASON_BAD_REQUEST_ID = "bad_request_id"  # an x-request-id that is not 1..128 printable ASCII characters

_CLOSE = [(b"connection", b"close")]


@dataclass(frozen=True, slots=True)
class DoorSettings:
    """What the doors check; the defaults are the loopback dev setup (no keys, no rate limit)."""

    api_keys: ApiKeys | None = None
    rate_limit: float = 0.0  # requests per second per client; 0: off
    rate_limit_burst: float = 0.0  # 0: the rate (at least 1)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    member_token: ClusterToken | None = None  # the cluster token, accepted on /metrics like a key
    auth_failure_rate: float = DEFAULT_AUTH_FAILURE_RATE  # failed key checks per second per address
    auth_failure_burst: float = DEFAULT_AUTH_FAILURE_BURST


class _HasRegistry(Protocol):
    registry: CollectorRegistry  # FrontendMetrics


class Admission(Protocol):
    """What the doors ask of the frontend's state (``pipeline/state.FrontendState``): whether a
    request may be admitted now, and the metrics registry for the refusal counter."""

    metrics: _HasRegistry

    def admission_refusal(self, cost: int = 1) -> tuple[str, DynamoError] | None: ...


class RefusalMetrics:
    """``dynamo_frontend_refused_requests_total{reason}``: requests the doors turned away before
    any work. One per registry (a test may build several apps on one registry)."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()

    @classmethod
    def counter(cls, registry: CollectorRegistry) -> Counter:
        counter = cls._by_registry.get(registry)
        if counter is None:
            counter = Counter(
                "dynamo_frontend_refused_requests",
                "HTTP requests refused before any work: reason is unauthenticated, auth_rate_limited, rate_limited, "
                "body_too_large, overloaded, draining, bad_request_id, or for connections connection_limit, idle_timeout, "
                "header_timeout, body_timeout",
                ("reason",),
                registry=registry,
            )
            cls._by_registry[registry] = counter
        return counter


class FrontDoors:
    """ASGI wrapper applying the checks of the module docstring in front of ``app``."""

    def __init__(
        self, app: Any, state: Admission, settings: DoorSettings, admission_paths: frozenset[str],
        render_error: Callable[[Scope, DynamoError], HttpError] | None = None,
    ) -> None:
        """``render_error``: the refusal's body for a request's path (default OpenAI's shape; the
        Anthropic routes answer in theirs)."""
        self.app = app
        self.render_error = render_error
        self.state = state
        self.settings = settings
        self.keys = settings.api_keys
        self.limiter = RateLimiter(settings.rate_limit, settings.rate_limit_burst) if settings.rate_limit > 0 else None
        self.auth_failures = (
            RateLimiter(settings.auth_failure_rate, settings.auth_failure_burst)
            if self.keys is not None and settings.auth_failure_rate > 0
            else None
        )
        self.max_body = settings.max_body_bytes
        self.admission_paths = admission_paths
        self._refused = RefusalMetrics.counter(state.metrics.registry)

    def _is_member(self, presented: bytes | None) -> bool:
        token = self.settings.member_token
        return token is not None and token.matches(presented)

    async def _refuse(self, scope: Scope, send: Any, reason: str, error: DynamoError, close: bool = False) -> None:
        self._refused.labels(reason).inc()
        rendered = self.render_error(scope, error) if self.render_error is not None else to_http_error(error)
        await send_error(send, rendered, _CLOSE if close else None)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        # x-request-id first: every answer from here on (refusals included) echoes it.
        try:
            send = echoing_send(send, assign_request_id(scope))
        except InvalidRequestError as exc:
            await self._refuse(scope, send, REASON_BAD_REQUEST_ID, exc)
            return
        unauthenticated: InvalidApiKeyError | None = None
        client: str | None = None
        if self.keys is not None and path not in OPEN_PATHS:
            presented = presented_key(scope["headers"])
            failures = self.auth_failures
            address = ""
            if failures is not None and (presented is not None or path != "/health"):
                peer = scope.get("client")
                address = peer[0] if peer else "unknown"
                wait = failures.waiting(address)
                if wait > 0.0:
                    error = RateLimitedError(
                        f"Too many failed API key checks from {address}; retry in {wait:.2f}s.", retry_after_s=wait
                    )
                    await self._refuse(scope, send, REASON_AUTH_RATE_LIMITED, error)
                    return
            client = self.keys.identify(presented)
            if client is None and path in MEMBER_PATHS and self._is_member(presented):
                client = MEMBER_CLIENT
            if client is None:
                if failures is not None and address:
                    failures.acquire(address)  # one failed check: a wrong key, or none where one is needed
                if path == "/health":
                    scope[HEALTH_DETAILS] = False
                elif presented is None:
                    unauthenticated = InvalidApiKeyError(
                        "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                        "(Authorization: Bearer YOUR_KEY) or in an x-api-key header."
                    )
                else:
                    unauthenticated = InvalidApiKeyError("Incorrect API key provided.")
        limiter = self.limiter
        if limiter is not None and path not in NOT_RATE_LIMITED:
            if client is None:
                peer = scope.get("client")
                client = peer[0] if peer else "unknown"
            wait = limiter.acquire(client)
            if wait > 0.0:
                await self._refuse(scope, send, REASON_RATE_LIMITED, rate_limited_error(limiter, wait))
                return
            scope[RATE_LIMIT_SCOPE_KEY] = (limiter, client)
        if unauthenticated is not None:
            await self._refuse(scope, send, REASON_UNAUTHENTICATED, unauthenticated)
            return
        if scope["method"] == "POST":
            length = declared_length(scope["headers"])
            if length is None:
                receive = capped_receive(receive, self.max_body)
            elif length > self.max_body:
                # Closing, not reading: the point is not to take in the 20 MB the client announced.
                await self._refuse(scope, send, REASON_BODY_TOO_LARGE, too_large(self.max_body), close=True)
                return
            if path in self.admission_paths:
                refusal = self.state.admission_refusal()
                if refusal is not None:
                    await self._refuse(scope, send, *refusal)
                    return
        await self.app(scope, receive, send)
