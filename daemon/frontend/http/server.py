"""The HTTP server: uvicorn with httptools on the running (uvloop) loop, on a socket we bind.

We bind the listening socket ourselves so that the processes of one ``--num-frontends`` fleet can
share one port (``SO_REUSEPORT``: the kernel spreads new connections over them) and so that port 0
resolves before the copies are started. Accepted sockets get ``TCP_NODELAY``: an SSE chunk is a few hundred
bytes, and Nagle's algorithm would hold each one back until the previous one is acknowledged. The
option is set on the listening socket, which Linux copies to every accepted one (and uvloop sets it
on TCP transports as well); only where that does not hold does each new connection pay a
``setsockopt`` of its own (``NoDelayHttpToolsProtocol``), which on a fresh connection per request
was a measurable share of the connection's cost.

With ``ssl_context`` (``--http-tls-cert-file``) the same socket serves HTTPS: uvicorn wraps each
accepted connection in that context (``shared/security/tls.server_context``: TLS 1.2 or newer).

Every connection also passes ``connections.HttpConnectionGuard`` (caps in total and per address,
idle/header/body deadlines), so slow or idle clients cannot hold descriptors forever.

uvicorn's own signal handling is disabled; the role's lifecycle owns signals and calls
``stop()`` after the frontend has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamod.daemon.frontend.http.connections import (
    HttpConnectionGuard,
    HttpConnectionLimits,
    guarded_protocol,
)

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 4096


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """httptools protocol that disables Nagle on every accepted connection."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass
        super().connection_made(transport)


def accepted_sockets_inherit_nodelay(sock: socket.socket) -> bool:
    """True when connections accepted on ``sock`` start with Nagle off: Linux copies the listening
    socket's ``TCP_NODELAY`` to them (elsewhere we do not rely on it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    except OSError:
        return False


def http_protocol_for(sock: socket.socket) -> type[HttpToolsProtocol]:
    """uvicorn's protocol as is when accepted sockets inherit ``TCP_NODELAY``, else ours that sets it."""
    return HttpToolsProtocol if accepted_sockets_inherit_nodelay(sock) else NoDelayHttpToolsProtocol


def bind_socket(host: str, port: int, *, reuse_port: bool = True) -> socket.socket:
    """A listening TCP socket with Nagle off (inherited by accepted sockets where the OS does that);
    with ``reuse_port`` other processes may bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # then NoDelayHttpToolsProtocol sets it per connection
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.started_event.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The role's lifecycle handles SIGTERM/SIGINT; uvicorn must not replace those handlers.
        yield


class HttpServer:
    """Serves ``app`` on ``sock`` until ``stop()``."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        *,
        keep_alive_s: int = 75,
        graceful_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
        connection_limits: HttpConnectionLimits | None = None,
        on_refused: Any = None,
    ) -> None:
        self.connections = HttpConnectionGuard(connection_limits or HttpConnectionLimits(), on_refused)
        tls: dict[str, Any] = {}
        if ssl_context is not None:
            tls = {"ssl_context_factory": lambda _config, _default: ssl_context}
        config = uvicorn.Config(
            app,
            http=guarded_protocol(http_protocol_for(sock), self.connections),
            loop="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=keep_alive_s,
            timeout_graceful_shutdown=max(1, int(graceful_s)),
            backlog=LISTEN_BACKLOG,
            **tls,
        )
        self._server = _Server(config)
        self._sock = sock
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="http-server")
        started = asyncio.ensure_future(self._server.started_event.wait())
        await asyncio.wait([started, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            await self._task  # raises the startup error
            raise RuntimeError("HTTP server stopped during startup")

    async def stop(self) -> None:
        """Stops accepting, closes idle keep-alive connections, waits for responses in progress."""
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    def force_stop(self) -> None:
        self._server.force_exit = True
        self._server.should_exit = True
