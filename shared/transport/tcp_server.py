"""TCP request-plane server: one asyncio Protocol per client connection, many streams on each.

Writes are batched (see ``tcp_connection``). When the socket's buffer fills up (``pause_writing``),
every stream of that connection waits and the connection stops reading; with per-stream credit
this only happens when the client process itself falls behind, never because one of its readers
is slow.

A connection that sends an oversize frame gets a connection-level error frame and is closed; a
frame that does not decode gets an error frame (for its stream when its id can be read) and the
connection carries on. Neither affects other connections.

Security (``guard``): with TLS configured each connection runs its own TLS session
(``tls_session``), so a failed handshake (no client certificate, a plaintext client, a foreign CA)
is counted and logged like any other refusal; with a cluster token the first frame must be a
matching hello (``framing``). Until both passed nothing is dispatched, the first frame may not
exceed ``HELLO_MAX_BYTES``, and a peer that takes longer than the handshake timeout is closed.

Connection limits (``ConnectionLimits``): past ``max_connections`` open connections a new one is
told ``overloaded`` (a connection-level error frame; a TLS peer just sees the close) and closed, so
a flood of connections cannot exhaust the process's descriptors. With a token or TLS, connections
that have not finished their handshake are *pending* and capped apart (``admission``: in total and
per peer address, the oldest pending one closed to make room, never an authenticated one), so idle
unauthenticated sockets cannot lock members out. A connection with no open stream
from which nothing has been read for ``idle_timeout_s`` is closed (a peer that opened a connection
and went quiet, or stalled in the middle of a frame); clients simply dial again for their next
request. A connection with open streams is never closed as idle: its client pings it while it
waits, and a slow handler is not the peer's fault.

A frozen or hung client (SIGSTOP, a blocked event loop) is found the other way round: a client
that runs the heartbeat pings every interval while it has streams open, so once a connection has
pinged, open streams and nothing read (and no write drained) for ``silent_client_timeout_s``, or
three of its observed ping intervals if longer, mean the client stopped. The connection is aborted
and its streams cancelled, which frees the engine's slots and KV blocks they held; the client, if
it ever thaws, sees its connection gone and dials again. A client without the heartbeat is never
judged this way: its silence says nothing.

A ping (``{stream_id: 0, ping: n}``) is answered with a pong from ``data_received`` itself: the
answer proves that this process's event loop runs, which is all the client's heartbeat asks. A
server that is frozen or whose loop is blocked answers nothing and its clients give up on it; a
handler that is merely slow (a long prefill) does not stop the loop, so its streams live on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET

from dynamod.shared.errors import (
    ConfigError,
    DynamoError,
    FrameTooLargeError,
    OverloadedError,
    ProtocolError,
    TransportError,
    error_to_wire,
)
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.token import REASON_HANDSHAKE_TIMEOUT, REASON_MISSING_TOKEN, REASON_TLS_HANDSHAKE
from dynamod.shared.transport.address import advertised_host
from dynamod.shared.transport.admission import ConnectionAdmission, PreAuthLimits
from dynamod.shared.transport.framing import (
    CONNECTION_STREAM_ID,
    DEFAULT_WINDOW_FRAMES,
    HEADER,
    HEADER_SIZE,
    HELLO_MAX_BYTES,
    MAX_WINDOW_FRAMES,
    ClientFrame,
    FrameReader,
    MalformedFrame,
    OversizeFrame,
    ServerFrame,
)
from dynamod.shared.transport.guard import DEFAULT_HANDSHAKE_TIMEOUT_S, ServerGuard
from dynamod.shared.transport.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S, RequestPlaneMetrics
from dynamod.shared.transport.plane import (
    DEFAULT_MAX_FRAME_BYTES,
    RequestContext,
    ServerAddress,
)
from dynamod.shared.transport.server_stream import ServerStream, ServesFromState, ServingState
from dynamod.shared.transport.tcp_connection import FrameConnection
from dynamod.shared.transport.tls_session import ServerTlsSession, TlsClosed

logger = logging.getLogger(__name__)

DEFAULT_MAX_STREAMS_PER_CONNECTION = 16384
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_IDLE_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How many connections one request-plane server holds, and how long one may sit idle
    (no open stream, nothing read); ``idle_timeout_s`` 0 keeps idle connections forever."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    # How long a pinging client with open streams may be silent before it is presumed frozen; 0: never.
    silent_client_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # Connections not yet through TLS and the token (``admission``): in all and per peer address
    # (0: the defaults), and how long one may take.
    max_pending: int = 0
    max_pending_per_peer: int = 0
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S

    @property
    def pre_auth(self) -> PreAuthLimits:
        return PreAuthLimits(self.max_pending, self.max_pending_per_peer)

    def validate(self) -> ConnectionLimits:
        if self.max_connections < 1:
            raise ConfigError(f"request-plane max connections must be at least 1, got {self.max_connections}")
        if self.handshake_timeout_s <= 0:
            raise ConfigError(f"request-plane handshake timeout must be above 0, got {self.handshake_timeout_s}")
        self.pre_auth.resolve(self.max_connections)
        if self.idle_timeout_s < 0:
            raise ConfigError(f"request-plane idle timeout must be 0 (off) or more, got {self.idle_timeout_s}")
        if self.silent_client_timeout_s < 0:
            raise ConfigError(
                f"request-plane silent-client timeout must be 0 (off) or more, got {self.silent_client_timeout_s}"
            )
        return self


class _TcpServerStream(ServerStream):
    __slots__ = ("conn", "stream_id")

    def __init__(self, conn: _ServerConnection, stream_id: int, ctx: RequestContext, credit: int) -> None:
        super().__init__(ctx, credit)
        self.conn = conn
        self.stream_id = stream_id

    def _blocked(self) -> bool:
        return self.credit <= 0 or self.conn.paused

    def _peer_gone(self) -> bool:
        return self.conn.closed

    def _write_data(self, item: Any) -> None:
        self.conn.write_frame(ServerFrame(self.stream_id, data=item))

    def _write_end(self) -> None:
        self.conn.write_frame(ServerFrame(self.stream_id, end=True))

    def _write_error(self, err: dict[str, Any]) -> None:
        self.conn.write_frame(ServerFrame(self.stream_id, error=err))


class _ServerConnection(FrameConnection):
    """One client connection: decodes client frames, runs streams, batches response frames."""

    def __init__(self, server: TcpRequestServer) -> None:
        super().__init__(server.max_frame_bytes, "?")
        self._server = server
        self._reader: FrameReader[ClientFrame] = FrameReader(ClientFrame, server.max_frame_bytes)
        self.streams: dict[int, _TcpServerStream] = {}
        # Security state (see ``connection_made``): an open server authenticates every peer at once.
        self.authenticated = True
        self.rejected = False
        self._hello: bytearray | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        # The client's heartbeat, as seen from here (see the module docstring): when it last
        # pinged (0: never), the interval between its last two pings, when the socket last took
        # our bytes after a stall, and the timer that judges its silence.
        self._last_ping = 0.0
        self._ping_gap = 0.0
        self._last_drain = 0.0
        self._silence_timer: asyncio.TimerHandle | None = None
        self._silence_due = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        server = self._server
        guard = server.guard
        if guard.guessing(peer or self.peer):
            # Too many wrong tokens from this address: closed before a byte is read or a slot taken.
            self.rejected = True
            self.authenticated = False
            if server.metrics is not None:
                server.metrics.rejected("tcp", "auth_rate_limited")
            self.close_transport()
            return
        admitted = (
            server.admission.open_established(self) if guard.open else server.admission.open(self, peer or self.peer)
        )
        if not admitted:
            self._refuse_over_limit()
            return
        server._connections.add(self)
        logger.debug("request_plane.tcp.connection_opened peer=%s", self.peer)
        idle_s = server.limits.idle_timeout_s
        if idle_s > 0:
            self._last_read = self._loop.time()
            self._idle_timer = self._loop.call_later(idle_s, self._idle_check)
        if guard.open:
            return
        self.authenticated = guard.token is None
        self._hello = None if self.authenticated else bytearray()
        if guard.ssl_context is not None:
            self.tls = ServerTlsSession(guard.ssl_context)
        self._handshake_timer = self._loop.call_later(guard.handshake_timeout_s, self._handshake_expired)

    # -- connection limits ---------------------------------------------------------------------

    def _refuse_over_limit(self) -> None:
        server = self._server
        self.rejected = True
        self.authenticated = False
        server.log_over_limit(self.peer)
        if server.guard.ssl_context is None:  # a TLS peer cannot read a frame before its handshake
            self._send_error(
                CONNECTION_STREAM_ID,
                OverloadedError(f"this server holds {server.limits.max_connections} connections already; retry later"),
            )
        self.close()

    def evict_pending(self, reason: str) -> None:
        """Closed unauthenticated to make room (``admission``): counted, not told (it said nothing)."""
        if self.closed or self.rejected:
            return
        self.rejected = True
        self.authenticated = False
        self._handshake_done()
        metrics = self._server.metrics
        if metrics is not None:
            metrics.rejected("tcp", f"evicted_{reason}")
        transport = self._transport
        if transport is not None:
            transport.abort()

    def _maybe_established(self) -> None:
        """Both checks passed (TLS handshaken where on, token presented where asked): a member."""
        if self.authenticated and not self.rejected and (self.tls is None or self.tls.handshaken):
            self._server.admission.establish(self)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self.closed:
            return
        idle_s = self._server.limits.idle_timeout_s
        quiet = self._loop.time() - self._last_read
        if self.streams or quiet < idle_s:
            self._idle_timer = self._loop.call_later(idle_s - quiet if not self.streams else idle_s, self._idle_check)
            return
        logger.info("request_plane.tcp.idle_close peer=%s idle_s=%.0f", self.peer, quiet)
        self.close()

    # -- a frozen client ----------------------------------------------------------------------

    def _on_ping(self) -> None:
        now = self._loop.time()
        if self._last_ping and self.streams:
            self._ping_gap = now - self._last_ping
        self._last_ping = now
        if self._silence_timer is None and self.streams and self._server.limits.silent_client_timeout_s > 0:
            self._arm_silence(now)

    def _silence_allowed_s(self) -> float:
        return max(self._server.limits.silent_client_timeout_s, 3.0 * self._ping_gap)

    def _arm_silence(self, now: float) -> None:
        step = max(0.05, self._silence_allowed_s() / 4)
        self._silence_due = now + step
        self._silence_timer = self._loop.call_at(self._silence_due, self._silence_check, step)

    def _silence_check(self, step: float) -> None:
        self._silence_timer = None
        if self.closed or not self.streams:
            return  # idle: the next ping re-arms
        now = self._loop.time()
        if now - self._silence_due > step:
            # Our own loop was stalled: the client's pings may be sitting unread in the socket.
            self._arm_silence(now)
            return
        allowed = self._silence_allowed_s()
        quiet = now - max(self._last_read, self._last_drain)
        if quiet < allowed:
            self._arm_silence(now)
            return
        logger.warning(
            "request_plane.tcp.client_silent peer=%s silent_s=%.1f allowed_s=%.1f open_streams=%d action=abort",
            self.peer, quiet, allowed, len(self.streams),
        )
        metrics = self._server.metrics
        if metrics is not None:
            metrics.peer_dead("tcp")
        transport = self._transport
        if transport is not None:
            transport.abort()  # a frozen peer would never take the bytes a graceful close waits to send

    # -- security handshake (TLS, then the hello) ------------------------------------------------

    def _handshake_done(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if self.closed or self.rejected:
            return
        if self.tls is not None and not self.tls.handshaken:
            self._rejected(REASON_HANDSHAKE_TIMEOUT, "TLS handshake not finished", tell=False)
        elif not self.authenticated:
            self._rejected(REASON_HANDSHAKE_TIMEOUT, "no hello")

    def _rejected(self, reason: str, detail: str, *, tell: bool = True) -> None:
        """Refuses the peer: counted, logged, told why when its session can carry a frame, closed."""
        if self.rejected:
            return
        self.rejected = True
        self.authenticated = False
        error = self._server.guard.reject(self.peer, reason, detail)
        self._handshake_done()
        if tell:
            self._send_error(CONNECTION_STREAM_ID, error)
        self.close()

    def _decrypt(self, data: bytes) -> bytes | None:
        """TLS records in, plaintext out (None once the session failed or ended). Handshake
        replies and alerts go out at once, so a refused client reads why before the close."""
        tls = self.tls
        assert tls is not None
        was_handshaken = tls.handshaken
        try:
            plain = tls.receive(data)
        except ssl.SSLError as exc:
            out = tls.outgoing()
            if out and self._transport is not None:
                self._transport.write(out)  # the alert
            if was_handshaken:
                logger.warning("request_plane.tcp.tls_error peer=%s reason=%s", self.peer, exc)
                self.close_transport()
            else:
                self.tls = None  # nothing more may be written inside a failed session
                self._rejected(REASON_TLS_HANDSHAKE, f"{exc.reason or exc}", tell=False)
            return None
        except TlsClosed:
            self.close()
            return None
        out = tls.outgoing()
        if out and self._transport is not None:
            self._transport.write(out)
        if tls.handshaken and not was_handshaken and self.authenticated:
            self._handshake_done()
            self._maybe_established()
        return plain

    def _authenticate(self, data: bytes) -> bytes | None:
        """Collects the first frame and checks it is a hello with the cluster token. Returns what
        follows it (requests pipelined behind the hello), or None while waiting or once refused."""
        hello = self._hello
        assert hello is not None
        hello += data
        if len(hello) < HEADER_SIZE:
            return None
        (size,) = HEADER.unpack_from(hello, 0)
        if size > HELLO_MAX_BYTES:
            self._rejected(REASON_MISSING_TOKEN, f"first frame of {size} bytes is not a hello")
            return None
        end = HEADER_SIZE + size
        if len(hello) < end:
            return None
        reason = self._server.guard.check_hello(bytes(hello[HEADER_SIZE:end]))
        if reason is not None:
            self._rejected(reason, "")
            return None
        self._hello = None
        self.authenticated = True
        self._handshake_done()
        self._maybe_established()
        return bytes(hello[end:])

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        if self.tls is not None:
            plain = self._decrypt(data)
            if not plain:
                return
            data = plain
        if not self.authenticated:
            if self.rejected:
                return
            rest = self._authenticate(data)
            if not rest:
                return
            data = rest
        for frame in self._reader.feed(data):
            if type(frame) is ClientFrame:
                self._on_frame(frame)
            elif isinstance(frame, MalformedFrame):
                self._on_malformed(frame)
            elif isinstance(frame, OversizeFrame):
                self._on_oversize(frame)
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._handshake_done()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None
        self._server._connections.discard(self)
        self._server.admission.close(self)
        if self.streams:
            logger.info(
                "request_plane.tcp.connection_lost peer=%s open_streams=%d reason=%s",
                self.peer,
                len(self.streams),
                exc or "closed by peer",
            )
        for stream in list(self.streams.values()):
            stream.cancel(None)
            stream.wake()

    def pause_writing(self) -> None:
        # The client is not reading: stop reading its frames too, so even error replies to a
        # flood of bad frames cannot pile up in our buffer.
        self.paused = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        self._last_drain = self._loop.time()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
        for stream in list(self.streams.values()):
            stream.wake()

    # -- frames in ----------------------------------------------------------------------------

    def _on_frame(self, frame: ClientFrame) -> None:
        sid = frame.stream_id
        if frame.endpoint is not UNSET:  # a request
            self._on_request(frame)
            return
        stream = self.streams.get(sid)
        if frame.credit is not UNSET:
            if stream is not None and frame.credit > 0:  # type: ignore[operator]
                stream.add_credit(frame.credit)  # type: ignore[arg-type]
        elif frame.cancel is True:
            if stream is not None:
                logger.debug(
                    "request_plane.tcp.cancel_received peer=%s request_id=%s",
                    self.peer,
                    stream.ctx.request_id,
                )
                stream.cancel(None)
        elif frame.ping is not UNSET:
            # Written even while paused: a pong is a few bytes, and a client whose reader is slow
            # must not also conclude that we are dead.
            self._on_ping()
            try:
                self.write_frame(ServerFrame(CONNECTION_STREAM_ID, pong=frame.ping))
            except DynamoError as exc:
                logger.debug("request_plane.tcp.pong_not_sent peer=%s reason=%s", self.peer, exc)
        else:
            self._on_malformed(
                MalformedFrame(sid or None, "frame is neither a request, a window update nor a cancel")
            )

    def _on_request(self, frame: ClientFrame) -> None:
        sid = frame.stream_id
        if sid <= CONNECTION_STREAM_ID or sid in self.streams:
            self._send_error(
                sid, ProtocolError(f"stream id {sid} is reserved or already open on this connection")
            )
            return
        if len(self.streams) >= self._server.max_streams_per_connection:
            self._send_error(
                sid,
                OverloadedError(f"{len(self.streams)} streams already open on this connection; retry later"),
            )
            return
        endpoint = frame.endpoint
        assert isinstance(endpoint, str)
        try:
            handler = self._server._state.handler_for(endpoint)
        except DynamoError as exc:
            self._send_error(sid, exc)
            return
        timeout = frame.timeout_s if frame.timeout_s is not UNSET else None
        deadline = time.monotonic() + timeout if timeout is not None else None
        request_id = frame.request_id if frame.request_id is not UNSET else self._server.next_request_id()
        headers = frame.headers if frame.headers is not UNSET else {}
        credit = frame.credit if frame.credit is not UNSET else DEFAULT_WINDOW_FRAMES
        credit = min(max(1, credit), MAX_WINDOW_FRAMES)  # type: ignore[type-var]
        ctx = RequestContext(request_id, endpoint, headers, deadline)  # type: ignore[arg-type]
        stream = _TcpServerStream(self, sid, ctx, credit)  # type: ignore[arg-type]
        self.streams[sid] = stream
        body = frame.body if frame.body is not UNSET else None
        self._server._state.start(stream, handler, body, self._on_stream_done)
        # Queued behind the new task's first step: whatever that step yields goes out in the same
        # loop pass instead of one pass later (a quick reply saves a whole iteration).
        self.flush_soon()

    def _on_stream_done(self, stream: ServerStream) -> None:
        assert isinstance(stream, _TcpServerStream)
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]

    def _on_malformed(self, frame: MalformedFrame) -> None:
        logger.warning(
            "request_plane.tcp.malformed_frame peer=%s stream_id=%s reason=%s",
            self.peer,
            frame.stream_id,
            frame.reason,
        )
        sid = frame.stream_id
        if sid is not None and sid in self.streams:
            # A broken frame for a running stream leaves that stream in an unknown state: stop it.
            self.streams[sid].cancel(ProtocolError(f"malformed frame: {frame.reason}"))
            return
        self._send_error(sid or CONNECTION_STREAM_ID, ProtocolError(f"malformed frame: {frame.reason}"))

    def _on_oversize(self, frame: OversizeFrame) -> None:
        logger.warning(
            "request_plane.tcp.oversize_frame peer=%s size=%d limit=%d action=close_connection",
            self.peer,
            frame.size,
            frame.limit,
        )
        self._send_error(
            CONNECTION_STREAM_ID,
            FrameTooLargeError(
                f"frame of {frame.size} bytes exceeds the server's maximum of {frame.limit} bytes"
            ),
        )
        self.close()

    # -- frames out ---------------------------------------------------------------------------

    def _send_error(self, sid: int, exc: DynamoError) -> None:
        try:
            self.write_frame(ServerFrame(sid, error=error_to_wire(exc)))
        except DynamoError as write_exc:
            logger.warning("request_plane.tcp.error_frame_failed peer=%s reason=%s", self.peer, write_exc)

    def close(self) -> None:
        """Flushes what is queued and closes the connection."""
        self.close_transport()


class TcpRequestServer(ServesFromState):
    """The default request-plane server: endpoints of this process behind one TCP listener."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        advertise_host: str | None = None,
        max_streams_per_connection: int = DEFAULT_MAX_STREAMS_PER_CONNECTION,
        security: RequestPlaneSecurity | None = None,
        metrics: RequestPlaneMetrics | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.limits = (limits or ConnectionLimits()).validate()
        self.guard = ServerGuard(
            security, transport="tcp", metrics=metrics, handshake_timeout_s=self.limits.handshake_timeout_s
        )
        self.metrics = metrics
        self.admission = ConnectionAdmission("request_plane.tcp", self.limits.max_connections, self.limits.pre_auth)
        self.refused_over_limit = 0
        self._over_limit_logged_at = -1e9
        self._over_limit_unlogged = 0
        self.host = host
        self.port = port
        self.max_frame_bytes = max_frame_bytes
        self.max_streams_per_connection = max_streams_per_connection
        self._request_ids = itertools.count(1)
        self._request_id_prefix = uuid.uuid4().hex[:12]
        self._advertise_host = advertise_host
        self._state = ServingState()
        self._connections: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None
        self._address: ServerAddress | None = None

    async def start(self) -> ServerAddress:
        if self._address is not None:
            return self._address
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _ServerConnection(self), self.host, self.port, reuse_address=True
            )
        except OSError as exc:
            raise TransportError(f"cannot listen on {self.host}:{self.port}: {exc}") from exc
        port = self._server.sockets[0].getsockname()[1]
        host = self._advertise_host or advertised_host(self.host)
        self._address = ServerAddress("tcp", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        logger.info(
            "request_plane.tcp.listening bind=%s:%d address=%s security=%s",
            self.host,
            port,
            self._address.address,
            self.guard.describe,
        )
        return self._address

    def log_over_limit(self, peer: str) -> None:
        """Counts a connection refused at ``max_connections``; logs at most one line a minute."""
        self.refused_over_limit += 1
        now = time.monotonic()
        if now - self._over_limit_logged_at < 60.0:
            self._over_limit_unlogged += 1
            return
        logger.warning(
            "request_plane.tcp.connection_refused peer=%s reason=max_connections limit=%d suppressed_since_last=%d",
            peer, self.limits.max_connections, self._over_limit_unlogged,
        )
        self._over_limit_logged_at = now
        self._over_limit_unlogged = 0

    def next_request_id(self) -> str:
        """An id for a request that came without one: unique, and cheaper than a uuid per request."""
        return f"{self._request_id_prefix}-{next(self._request_ids)}"

    def stats(self) -> dict[str, int]:
        """Connections, streams and bytes queued for sending (for status pages and tests)."""
        return {
            "connections": len(self._connections),
            "pending": self.admission.pending,
            "evicted": self.admission.evicted,
            "inflight": self._state.inflight,
            "write_buffer_bytes": sum(c.write_buffer_bytes for c in self._connections),
            "streams_waiting_for_credit": sum(
                1 for c in self._connections for s in c.streams.values() if s.credit <= 0
            ),
        }

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stops accepting, lets in-flight streams finish for up to ``grace_s``, cancels the rest
        (their clients get UnavailableError), then closes every connection."""
        if self._state.stopping and self._server is None:
            return
        self._state.stopping = True
        inflight = self._state.inflight
        logger.info("request_plane.tcp.stopping inflight=%d grace_s=%s", inflight, grace_s)
        server = self._server
        if server is not None:
            server.close()
        cancelled = await self._state.drain(grace_s)
        for conn in list(self._connections):
            conn.close()
        if server is not None:
            await server.wait_closed()
        self._server = None
        logger.info(
            "request_plane.tcp.stopped served_to_end=%d cancelled=%d", inflight - cancelled, cancelled
        )


