"""The OpenAI port's connection rules: caps and deadlines applied to every HTTP connection before
its request reaches the doors (so before any API key is checked).

uvicorn starts its keep-alive timer only after a response: a client that connects and sends
nothing, or trickles its headers or body a byte at a time, holds a socket and a descriptor for as
long as it likes (100 of each kind stayed open 150 s; descriptors went from 32 to 332). Here each
connection moves through phases with a deadline each:

- ``idle``: connected, no byte of a request yet: ``idle_timeout_s``, then closed without a word
  (after a response, uvicorn's own keep-alive timeout applies instead);
- ``headers``: from the first byte of a request to the end of its headers: ``header_timeout_s``,
  then ``408`` and closed;
- ``body``: from the end of the headers to the end of the body: ``body_timeout_s``, then ``408``
  (when no response started) and closed; the endpoint reading it sees the client gone.

While the application handles the request nothing is timed here: a long generation is not the
client's fault. Connections are counted in total and per client address when accepted; past
``max_connections`` or ``max_connections_per_address`` the newcomer gets ``503`` with
``Retry-After`` and is closed at once. Each refusal and expiry is counted in
``dynamo_frontend_refused_requests_total{reason}`` (``HttpConnectionGuard.on_refused``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 8192
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 1024
DEFAULT_IDLE_TIMEOUT_S = 20.0
DEFAULT_HEADER_TIMEOUT_S = 20.0
DEFAULT_BODY_TIMEOUT_S = 60.0

REASON_CONNECTION_LIMIT = "connection_limit"
REASON_IDLE = "idle_timeout"
REASON_HEADERS = "header_timeout"
REASON_BODY = "body_timeout"

_IDLE, _HEADERS, _BODY, _APP = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class HttpConnectionLimits:
    """Caps and deadlines of the module docstring; a timeout of 0 turns that one off."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def validate(self) -> HttpConnectionLimits:
        if self.max_connections < 1 or self.max_connections_per_address < 1:
            raise ConfigError("--http-max-connections and --http-max-connections-per-address must be at least 1")
        if min(self.idle_timeout_s, self.header_timeout_s, self.body_timeout_s) < 0:
            raise ConfigError("HTTP idle/header/body timeouts must be 0 (off) or more")
        return self


def _raw_response(status: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n".encode() + extra + b"\r\n" + body
    )


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()


class HttpConnectionGuard:
    """The connection table of one HTTP server, shared by all its connections."""

    def __init__(self, limits: HttpConnectionLimits, on_refused: Callable[[str], None] | None = None) -> None:
        self.limits = limits.validate()
        self.on_refused = on_refused
        self.open = 0
        self.by_address: dict[str, int] = {}
        self._logged_at = -1e9
        self._unlogged = 0

    def admit(self, host: str) -> str | None:
        """Counts a new connection; the refusal reason when it is one too many."""
        limits = self.limits
        if self.open >= limits.max_connections or self.by_address.get(host, 0) >= limits.max_connections_per_address:
            return REASON_CONNECTION_LIMIT
        self.open += 1
        self.by_address[host] = self.by_address.get(host, 0) + 1
        return None

    def release(self, host: str) -> None:
        self.open -= 1
        left = self.by_address.get(host, 1) - 1
        if left > 0:
            self.by_address[host] = left
        else:
            self.by_address.pop(host, None)

    def refused(self, reason: str, host: str = "") -> None:
        """Counts a refused or cut connection; logs at most one line a minute (a flood of slow
        clients must not become a flood of log lines)."""
        if self.on_refused is not None:
            self.on_refused(reason)
        now = time.monotonic()
        if now - self._logged_at < 60.0:
            self._unlogged += 1
            return
        logger.warning(
            "http.connection_cut peer=%s reason=%s open=%d suppressed_since_last=%d",
            host or "?", reason, self.open, self._unlogged,
        )
        self._logged_at = now
        self._unlogged = 0


def guarded_protocol(base: type[Any], guard: HttpConnectionGuard) -> type[Any]:
    """``base`` (uvicorn's httptools protocol) with the caps and deadlines of ``guard``."""

    class GuardedHttpProtocol(base):  # type: ignore[valid-type, misc]
        _guard = guard

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._phase = _IDLE
            self._timer: asyncio.TimerHandle | None = None
            self._host = self.client[0] if self.client else "?"
            refusal = self._guard.admit(self._host)
            self._counted = refusal is None
            if refusal is not None:
                self._guard.refused(refusal, self._host)
                limits = self._guard.limits
                body = _error_body(
                    f"this server holds {limits.max_connections} connections, at most "
                    f"{limits.max_connections_per_address} from one address; retry later",
                    "overloaded",
                )
                transport.write(_raw_response("503 Service Unavailable", body, b"retry-after: 1\r\n"))
                transport.close()
                return
            self._arm(self._guard.limits.idle_timeout_s, REASON_IDLE)

        def _arm(self, seconds: float, reason: str) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if seconds > 0:
                self._timer = self.loop.call_later(seconds, self._expired, reason)

        def _expired(self, reason: str) -> None:
            self._timer = None
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            self._guard.refused(reason, self._host)
            cycle = self.cycle
            started = cycle is not None and cycle.response_started
            if reason != REASON_IDLE and not started:
                what = "headers" if reason == REASON_HEADERS else "body"
                transport.write(_raw_response("408 Request Timeout", _error_body(
                    f"the request {what} did not arrive in time; send requests without pauses", "request_timeout")))
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # nothing more may be written after the 408
                cycle.message_event.set()
            transport.close()

        def data_received(self, data: bytes) -> None:
            if self._phase == _IDLE and data:
                self._phase = _HEADERS
                self._arm(self._guard.limits.header_timeout_s, REASON_HEADERS)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            if self._phase == _HEADERS:
                self._phase = _BODY
                self._arm(self._guard.limits.body_timeout_s, REASON_BODY)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            if self._phase == _BODY:
                if self.cycle is not None and self.cycle.response_complete:
                    # Answered before its body was in (a refusal): now idle, and uvicorn's
                    # keep-alive timer was cancelled by the body's bytes, so ours stands in.
                    self._phase = _IDLE
                    self._arm(self._guard.limits.idle_timeout_s, REASON_IDLE)
                else:
                    self._phase = _APP
                    self._arm(0, "")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._phase != _BODY:  # a body still owed keeps its deadline
                self._phase = _IDLE  # uvicorn's keep-alive timer now runs; a new request restarts ours
                self._arm(0, "")

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._counted:
                self._counted = False
                self._guard.release(self._host)
            super().connection_lost(exc)

    GuardedHttpProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHttpProtocol
