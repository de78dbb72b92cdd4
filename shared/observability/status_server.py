"""The per-process system status server: ``/health``, ``/live``, ``/metrics`` (and what a role adds).

A deliberately tiny HTTP/1.1 responder on asyncio streams: ``shared/`` stays free of web frameworks
and every process (workers, routers, planner) gets the same three routes with no extra dependency.
``/health`` is 200 only when the process says it is ready (its endpoints are served and it is not
shutting down); ``/live`` is 200 while the event loop runs; ``/metrics`` is Prometheus text.

With the cluster token on, the token (``Authorization: Bearer <token>``) is what separates a member
from anyone who can reach the port:

- ``/metrics`` answers 401 without it: its series name worker ids, models, LoRA adapters and the
  load on each, a map of the cluster and its traffic. Every reader in the tree sends the token
  (``metrics_auth_headers``): the console's scraper, the planner, a frontend fleet adding up its
  members, and Prometheus through ``authorization.credentials_file`` (``deploy/prometheus``).
- ``/health`` follows the frontend's rule: a caller without the token gets the status and the
  in-flight count only, not the served endpoints, instance ids or role extras (router workers,
  global-router pools). The status code is the same either way, so readiness probes need no
  secret; ``inflight`` stays public because it is a load figure, not an identity, and
  ``dynamod up``'s scaler picks the worker to remove by it.
- ``/live`` stays open: a liveness probe carries no secret.
- A route a role adds (``add_route``: a ``--num-frontends`` member's ``/v1/traces``, whose spans
  name requests, workers and models) is guarded as ``/metrics`` is.

Guessing the token is rate-limited per client address (``shared/security/rate_limit``, as the
frontend's doors do for API keys): past ``DEFAULT_AUTH_FAILURE_BURST`` wrong or missing tokens on
``/metrics`` (then one a second), that address gets 429 before any token is checked. Connections
are capped (``MAX_CONNECTIONS``, ``transport/admission``) and one that sends no request head for
``_HEAD_TIMEOUT_S`` is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.rate_limit import (
    DEFAULT_AUTH_FAILURE_BURST,
    DEFAULT_AUTH_FAILURE_RATE,
    RateLimiter,
)
from dynamod.shared.security.token import REASON_BAD_TOKEN, REASON_MISSING_TOKEN, ClusterToken
from dynamod.shared.transport.address import advertised_host, join_host_port
from dynamod.shared.transport.admission import ConnectionAdmission

logger = logging.getLogger(__name__)

HealthProbe = Callable[[], tuple[bool, dict]]
QueryRoute = Callable[[str], tuple[int, bytes]]
"""An added ``GET`` route: its query string (without ``?``) -> status and JSON body."""
_MAX_REQUEST_BYTES = 16 * 1024
_HEAD_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
"""Scrapers, probes and the console: a handful each; a flood gets 503 and a closed socket."""
PUBLIC_HEALTH_FIELDS = ("inflight",)
"""What ``/health`` shows beside ``status`` to a caller without the token (see the module docstring)."""


def metrics_auth_headers(token: ClusterToken | None) -> dict[str, str]:
    """The headers a member sends to read another process's ``/metrics`` (none without a token)."""
    return {"Authorization": f"Bearer {token.value}"} if token is not None else {}


def _error_body(message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode() + b"\n"


def _unauthorized_body(reason: str, path: str = "/metrics") -> bytes:
    """An OpenAI-shaped error, as the frontend's 401s are, saying what to send."""
    told = "no cluster token was presented" if reason == REASON_MISSING_TOKEN else "the cluster token presented is wrong"
    message = (
        f"{path} needs the cluster token and {told}: send 'Authorization: Bearer <token>' with the token "
        "of --cluster-token-file / DYN_CLUSTER_TOKEN"
    )
    return _error_body(message, reason)


def bearer_token(head: bytes) -> bytes | None:
    """The credential of an ``Authorization: Bearer ...`` header in a request head, if any."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, credential = value.strip().partition(b" ")
            return credential.strip() if scheme.lower() == b"bearer" and credential.strip() else None
    return None


class StatusServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        health: HealthProbe,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        token: ClusterToken | None = None,
    ) -> None:
        self._registry = registry
        self._token = token
        self._health = health
        self._host = host
        # ``url`` goes into discovery (instances' system_url) for scrapers on other hosts: never a wildcard.
        self._advertise_host = advertise_host or advertised_host(host)
        self._port = port
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._slots = ConnectionAdmission("status_server", MAX_CONNECTIONS)
        self._auth_failures = RateLimiter(DEFAULT_AUTH_FAILURE_RATE, DEFAULT_AUTH_FAILURE_BURST) if token else None
        self._routes: dict[str, QueryRoute] = {}
        self._guarded = {"/metrics"}
        self.url = ""

    def add_route(self, path: str, handler: QueryRoute) -> None:
        """Serves ``GET path`` with ``handler``, behind the cluster token like ``/metrics``. Why
        here: a process with a private status server (a ``--num-frontends`` member) is reachable
        only through it, whatever its public port hands to another process."""
        if path in ("/health", "/live", "/metrics"):
            raise ValueError(f"{path} is the status server's own route")
        self._routes[path] = handler
        self._guarded.add(path)

    async def start(self) -> str:
        try:
            self._server = await asyncio.start_server(self._serve, self._host, self._port)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve /health and /metrics on {self._host}:{self._port}: {exc.strerror or exc}; "
                "pick another --system-port (0 = any free port) or stop the process holding it"
            ) from None
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{join_host_port(self._advertise_host, port)}"
        logger.info("status server listening url=%s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            # Since Python 3.12 wait_closed() also waits for open connections, and a scraper keeps
            # its keep-alive connection open between scrapes: close them, or shutdown (and the
            # lease revocation after it) would never get past here.
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._slots.open_established(writer):
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            writer.close()
            return
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=_HEAD_TIMEOUT_S)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    return
                if len(head) > _MAX_REQUEST_BYTES:
                    return
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                parts = request_line.split()
                keep_alive = b"connection: close" not in head.lower()
                if len(parts) < 2:
                    await self._write(writer, 400, "text/plain", b"bad request\n", False)
                    return
                method, (path, _, query) = parts[0], parts[1].partition("?")
                failures = self._auth_failures
                wait = failures.waiting(address) if failures is not None and path in self._guarded else 0.0
                refusal = self._metrics_refusal(method, path, head) if wait == 0.0 else None
                extra = b""
                if wait > 0.0:
                    # Too many wrong tokens from here: refused before this one is even compared.
                    status, ctype = 429, "application/json"
                    body = _error_body(f"too many failed cluster token checks from {address}; retry in {wait:.1f}s",
                                       "rate_limit_exceeded")
                    extra = f"Retry-After: {max(1, round(wait))}\r\n".encode()
                elif refusal is not None:
                    if failures is not None:
                        failures.acquire(address)
                    status, ctype, body = 401, "application/json", _unauthorized_body(refusal, path)
                    extra = b'WWW-Authenticate: Bearer realm="dynamod"\r\n'
                else:
                    status, ctype, body = self._route(method, path, self._may_see_details(head), query)
                await self._write(writer, status, ctype, body if method != "HEAD" else b"", keep_alive, extra)
                if not keep_alive:
                    return
        finally:
            self._slots.close(writer)
            self._writers.discard(writer)
            writer.close()

    def _may_see_details(self, head: bytes) -> bool:
        return self._token is None or self._token.matches(bearer_token(head))

    def _metrics_refusal(self, method: str, path: str, head: bytes) -> str | None:
        """Why a ``/metrics`` (or added route's) request is refused (missing or wrong token), or None to serve it."""
        if self._token is None or path not in self._guarded or method not in ("GET", "HEAD"):
            return None
        presented = bearer_token(head)
        if presented is None:
            return REASON_MISSING_TOKEN
        return None if self._token.matches(presented) else REASON_BAD_TOKEN

    def _route(self, method: str, path: str, details: bool = True, query: str = "") -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/live":
            return 200, "application/json", b'{"status":"live"}\n'
        if path == "/health":
            ready, detail = self._health()
            if not details:
                detail = {k: v for k, v in detail.items() if k in PUBLIC_HEALTH_FIELDS}
            body = json.dumps({"status": "ready" if ready else "notready", **detail}).encode() + b"\n"
            return (200 if ready else 503), "application/json", body
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        handler = self._routes.get(path)
        if handler is not None:
            try:
                status, body = handler(query)
            except Exception:  # noqa: BLE001 - a route's bug answers 500, it must not drop the connection
                logger.exception("status route failed path=%s", path)
                return 500, "application/json", _error_body(f"{path} failed; see the process's log", "internal_error")
            return status, "application/json", body
        return 404, "text/plain", b"not found\n"

    @staticmethod
    async def _write(
        writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes, keep_alive: bool, extra: bytes = b""
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
                  429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}
        head = (
            f"HTTP/1.1 {status} {reason.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n"
        )
        writer.write(head.encode() + extra + b"\r\n" + body)
        await writer.drain()

