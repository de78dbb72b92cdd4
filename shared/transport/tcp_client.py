"""TCP request-plane client: one multiplexed connection per server address, opened on first use.

Each ``stream()`` call takes the next stream id on the shared connection. Frames from the server
are routed to their stream from ``data_received`` without a task per stream; the reader of a
stream only wakes up when its buffer was empty. When the connection drops, every open stream on
it raises TransportError (the caller may migrate the request) and the next ``stream()`` to that
address reconnects.

A connection with open streams is also watched for silence (``liveness``): one timer per
connection, never per stream or token, pings the server every heartbeat interval, and when nothing
at all (data, end, pong) arrived for the heartbeat timeout the server is presumed frozen or hung:
the connection is aborted and its streams fail with TransportError, exactly as if it had dropped.
The connection is forgotten at once, so the next stream to that address dials afresh (a thawed
server is reachable again without any state to clear).

Security (``ClientCredentials``): with TLS configured every connection is dialled over TLS and the
server's certificate verified against the cluster CA (and, unless told not to, against the dialled
host); with a cluster token the hello frame goes out from ``connection_made``, ahead of any request.
A server that refuses the token answers ``unauthenticated``, one that refuses our certificate sends
a TLS alert; either way the streams fail with ``UnauthenticatedError`` (not migrated: every member
would refuse the same credentials).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import weakref
from collections.abc import Callable
from typing import Any

from msgspec import UNSET

from dynamod.shared.errors import (
    DynamoError,
    ProtocolError,
    TransportError,
    UnauthenticatedError,
    error_from_wire,
)
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.transport.client_stream import ClientStream, StreamingClient
from dynamod.shared.transport.framing import (
    CONNECTION_STREAM_ID,
    DEFAULT_WINDOW_FRAMES,
    ClientFrame,
    FrameReader,
    MalformedFrame,
    OversizeFrame,
    ServerFrame,
)
from dynamod.shared.transport.guard import ClientCredentials
from dynamod.shared.transport.liveness import HeartbeatConfig, RequestPlaneMetrics
from dynamod.shared.transport.plane import DEFAULT_MAX_FRAME_BYTES, ServerAddress
from dynamod.shared.transport.tcp_connection import FrameConnection

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 5.0

# TLS alerts by which a server refuses the client's certificate (OpenSSL's reason names).
_REFUSAL_ALERTS = (
    "ALERT_CERTIFICATE_REQUIRED",
    "ALERT_BAD_CERTIFICATE",
    "ALERT_UNKNOWN_CA",
    "ALERT_CERTIFICATE_UNKNOWN",
    "ALERT_ACCESS_DENIED",
)


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"bad tcp address {address!r}; expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class _ClientConnection(FrameConnection):
    """One connection to one server, shared by every stream this process opens to it."""

    def __init__(
        self,
        address: str,
        max_frame_bytes: int,
        on_closed: Callable[[_ClientConnection], None],
        heartbeat: HeartbeatConfig | None = None,
        metrics: RequestPlaneMetrics | None = None,
        hello: ClientFrame | None = None,
    ) -> None:
        super().__init__(max_frame_bytes, address)
        self.address = address
        self._hello = hello
        self._received_any = False
        self._reader: FrameReader[ServerFrame] = FrameReader(ServerFrame, max_frame_bytes)
        self._on_closed = on_closed
        self._writable: asyncio.Future[None] | None = None
        self._next_sid = 1
        # Heartbeat state. ``_rx`` is a flag, not a timestamp, so the receive path pays one store
        # and no clock read; the timer turns it into ``_last_rx`` once per interval.
        self._heartbeat = heartbeat or HeartbeatConfig(0.0)
        self._metrics = metrics
        self._pinging = self._heartbeat.enabled  # False too once the server proved it predates pings
        self._hb_handle: asyncio.TimerHandle | None = None
        self._hb_due = 0.0
        self._rx = False
        self._last_rx = 0.0
        self._pings_sent = 0
        self._pong_seen = False
        # Weak references: a stream its reader dropped (``break`` without ``aclose``) is collected,
        # and its finalizer sends the cancel.
        self.streams: dict[int, weakref.ref[TcpClientStream]] = {}

    def allocate_stream_id(self) -> int:
        sid = self._next_sid
        self._next_sid = sid + 1
        return sid

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._hello is not None:
            self.write_frame(self._hello)  # first on the wire: queued before any stream can be

    def data_received(self, data: bytes) -> None:
        self._rx = True  # any byte proves the server's loop is alive
        self._received_any = True
        streams = self.streams
        for frame in self._reader.feed(data):
            if type(frame) is ServerFrame:
                item = frame.data
                if item is not UNSET:
                    ref = streams.get(frame.stream_id)
                    if ref is not None and (stream := ref()) is not None:
                        stream.push_data(item)
                elif frame.end is True:
                    ref = streams.pop(frame.stream_id, None)
                    if ref is not None and (stream := ref()) is not None:
                        stream.push_end()
                elif frame.error is not UNSET:
                    self._on_error_frame(frame.stream_id, frame.error)  # type: ignore[arg-type]
                elif frame.pong is not UNSET:
                    self._pong_seen = True
                else:
                    self._fail(
                        ProtocolError(f"server {self.address} sent a frame with no data, error or end")
                    )
                    return
            elif isinstance(frame, MalformedFrame):
                ref = streams.pop(frame.stream_id, None) if frame.stream_id is not None else None
                if ref is not None and (stream := ref()) is not None:
                    stream.push_error(ProtocolError(f"malformed frame from {self.address}: {frame.reason}"))
                else:
                    self._fail(TransportError(f"malformed frame from {self.address}: {frame.reason}"))
                    return
            elif isinstance(frame, OversizeFrame):
                self._fail(
                    TransportError(
                        f"server {self.address} sent a frame of {frame.size} bytes over the limit of {frame.limit}"
                    )
                )
                return

    def _on_error_frame(self, sid: int, err: dict[str, Any]) -> None:
        if sid == CONNECTION_STREAM_ID:
            exc = error_from_wire(err)
            if isinstance(exc, ProtocolError) and self._pings_sent and not self._pong_seen:
                # A server that predates the heartbeat rejects the ping as malformed but keeps the
                # connection: stop pinging it and rely on TCP keep-alive, as before.
                self._pinging = False
                self._stop_heartbeat()
                logger.info(
                    "request_plane.tcp.heartbeat_unsupported address=%s action=keepalive_only", self.address
                )
                return
            # A refusal of our credentials reaches every stream's caller as UnauthenticatedError,
            # which reports it; a warning here would say it twice (dynamoctl's one line).
            logger.log(
                logging.INFO if isinstance(exc, UnauthenticatedError) else logging.WARNING,
                "request_plane.tcp.connection_error address=%s code=%s message=%s",
                self.address,
                exc.code,
                exc,
            )
            self._fail(exc)
            return
        ref = self.streams.pop(sid, None)
        if ref is not None and (stream := ref()) is not None:
            stream.push_error(error_from_wire(err))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_heartbeat()
        self._on_closed(self)
        if self.streams:
            logger.info(
                "request_plane.tcp.connection_lost address=%s open_streams=%d reason=%s",
                self.address,
                len(self.streams),
                exc or "closed by server",
            )
        self._fail_streams(self._lost_error(exc))
        self._wake_writers()

    def _lost_error(self, exc: Exception | None) -> TransportError | UnauthenticatedError:
        reason = f"{exc or 'closed by the server'}"
        hint = " (TLS: if the server requires client certificates, check --tls-cert-file/--tls-key-file)"
        if isinstance(exc, ssl.SSLError) and (exc.reason or "").endswith(_REFUSAL_ALERTS):
            # The server's TLS refused our certificate (or its absence): every member would, so this
            # is a configuration problem to report, not a dead worker to migrate away from.
            return UnauthenticatedError(f"{self.address} refused this process's TLS certificate: {reason}{hint}")
        if isinstance(exc, ssl.SSLError) or (
            self._transport is not None and self._transport.get_extra_info("sslcontext") is not None
            and not self._received_any
        ):
            reason += hint
        return TransportError(f"connection to {self.address} lost: {reason}")

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_writers()

    # -- frames out ---------------------------------------------------------------------------

    async def wait_writable(self) -> None:
        """Waits while the socket buffer is over its high-water mark (large request bodies)."""
        while self.paused and not self.closed:
            if self._writable is None or self._writable.done():
                self._writable = self._loop.create_future()
            await self._writable

    def _wake_writers(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- heartbeat ----------------------------------------------------------------------------

    def watch(self) -> None:
        """A stream opened: make sure the connection's heartbeat timer runs. Idle connections
        have no timer (nothing waits on them; the next stream re-arms it)."""
        if self._hb_handle is None and self._pinging and not self.closed:
            now = self._loop.time()
            self._rx = False
            self._last_rx = now  # silence is counted from when someone started waiting
            self._arm(now)

    def _arm(self, now: float) -> None:
        self._hb_due = now + self._heartbeat.interval_s
        self._hb_handle = self._loop.call_at(self._hb_due, self._tick)

    def _stop_heartbeat(self) -> None:
        if self._hb_handle is not None:
            self._hb_handle.cancel()
            self._hb_handle = None

    def _tick(self) -> None:
        self._hb_handle = None
        if self.closed or not self._pinging:
            return
        now = self._loop.time()
        if self._rx:
            self._rx = False
            self._last_rx = now
        elif now - self._hb_due > self._heartbeat.interval_s:
            # Our own loop was stalled: the server's bytes may be sitting unread in the socket
            # (uvloop runs timers before polling), so this tick is no evidence either way.
            pass
        elif now - self._last_rx >= self._heartbeat.timeout_s:
            self._declare_dead(now - self._last_rx)
            return
        if not self.streams:
            return  # idle: stop until the next stream opens
        self._pings_sent += 1
        try:
            self.write_frame(ClientFrame(CONNECTION_STREAM_ID, ping=self._pings_sent))
        except DynamoError as exc:  # closed under us; connection_lost does the rest
            logger.debug("request_plane.tcp.ping_not_sent address=%s reason=%s", self.address, exc)
            return
        self._arm(now)

    def _declare_dead(self, silent_s: float) -> None:
        """The server said nothing for the heartbeat timeout: presumed frozen or hung. Its streams
        fail now (migratable) and the connection is aborted, not closed: a frozen peer would
        never take the bytes a graceful close waits to send."""
        open_streams = len(self.streams)
        logger.warning(
            "request_plane.tcp.peer_dead address=%s silent_s=%.1f timeout_s=%.1f open_streams=%d action=abort",
            self.address,
            silent_s,
            self._heartbeat.timeout_s,
            open_streams,
        )
        if self._metrics is not None:
            self._metrics.peer_dead("tcp")
        self._fail_streams(
            TransportError(
                f"server {self.address} sent nothing for {silent_s:.1f}s (heartbeat timeout "
                f"{self._heartbeat.timeout_s:g}s): presumed frozen or hung"
            )
        )
        self.abort()

    # -- teardown -----------------------------------------------------------------------------

    def _fail_streams(self, exc: BaseException) -> None:
        refs = list(self.streams.values())
        self.streams.clear()
        for ref in refs:
            stream = ref()
            if stream is not None:
                stream.push_error(exc)

    def _fail(self, exc: BaseException) -> None:
        """The connection cannot be trusted any more: fail its streams and close it."""
        self._fail_streams(exc)
        self.close()

    def close(self) -> None:
        """Sends what is queued (cancels, credit), then closes."""
        self._stop_heartbeat()
        self.close_transport()
        if not self.closed:
            self.closed = True
            self._on_closed(self)

    def abort(self) -> None:
        """Drops the connection without sending what is queued."""
        self._stop_heartbeat()
        self._wbuf = bytearray()
        if not self.closed:
            self.closed = True
            self._on_closed(self)
        transport = self._transport
        if transport is not None:
            transport.abort()
        self._wake_writers()


class TcpClientStream(ClientStream):
    """One request on a shared TCP connection."""

    __slots__ = ("_conn",)
    _client: TcpRequestClient

    def __init__(self, *request: Any) -> None:
        """``ClientStream``'s arguments (``StreamingClient.stream`` passes them)."""
        super().__init__(*request)
        self._conn: _ClientConnection | None = None

    async def _open(self) -> None:
        conn = await self._client.connection(self.address)
        if conn.paused:
            await conn.wait_writable()
        sid = conn.allocate_stream_id()
        frame = ClientFrame(
            sid,
            endpoint=self._endpoint,
            headers=self._headers if self._headers else UNSET,
            body=self._body,
            request_id=self._request_id if self._request_id is not None else UNSET,
            timeout_s=float(self.timeout_s) if self.timeout_s is not None else UNSET,
            credit=self.window,
        )
        conn.write_frame(frame)  # FrameTooLargeError / ProtocolError / TransportError leave no trace
        conn.streams[sid] = weakref.ref(self)
        conn.watch()
        self._conn = conn
        self._sid = sid
        self._body = None  # the request is on its way; do not pin a large prompt for the stream's life

    def _send_grant(self, frames: int) -> None:
        conn = self._conn
        if conn is not None and not conn.closed:
            conn.write_frame(ClientFrame(self._sid, credit=frames))

    def _send_cancel(self) -> None:
        conn = self._conn
        if conn is None:
            return
        conn.streams.pop(self._sid, None)  # stream ids are never reused: the entry is this stream's
        if not conn.closed:
            conn.write_frame(ClientFrame(self._sid, cancel=True))


class TcpRequestClient(StreamingClient[TcpClientStream]):
    """Opens request streams to TCP request-plane servers; one connection per server address."""

    stream_class = TcpClientStream

    def __init__(
        self,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        heartbeat: HeartbeatConfig | None = None,
        metrics: RequestPlaneMetrics | None = None,
        security: RequestPlaneSecurity | None = None,
    ) -> None:
        self.credentials = ClientCredentials(security)
        self.max_frame_bytes = max_frame_bytes
        self.window_frames = window_frames
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat = (heartbeat or HeartbeatConfig()).validate()
        self.metrics = metrics
        self._conns: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Task[_ClientConnection]] = {}
        self._closed = False

    def connection_count(self) -> int:
        return sum(1 for c in self._conns.values() if not c.closed)

    async def connection(self, address: ServerAddress) -> _ClientConnection:
        """The open connection to ``address``, connecting (once, however many callers) if needed."""
        if self._closed:
            raise TransportError("request plane client is closed")
        key = address.address
        conn = self._conns.get(key)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_task(self._connect(key))
            self._connecting[key] = pending
            pending.add_done_callback(lambda task, key=key: self._connect_done(key, task))
        return await asyncio.shield(pending)

    def _connect_done(self, key: str, task: asyncio.Task[_ClientConnection]) -> None:
        if self._connecting.get(key) is task:
            del self._connecting[key]
        if not task.cancelled():
            task.exception()  # retrieved here so an abandoned attempt is not reported as unhandled

    async def _connect(self, key: str) -> _ClientConnection:
        host, port = parse_host_port(key)
        loop = asyncio.get_running_loop()
        creds = self.credentials
        tls = creds.ssl_context
        hello = creds.hello()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(
                        key, self.max_frame_bytes, self._forget, self.heartbeat, self.metrics, hello
                    ),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                    ssl_handshake_timeout=self.connect_timeout_s if tls is not None else None,
                )
        except (OSError, TimeoutError) as exc:
            logger.info(
                "request_plane.tcp.connect_failed address=%s reason=%s", key, exc or type(exc).__name__
            )
            hint = " (TLS: check --tls-ca-file and the server's certificate)" if isinstance(exc, ssl.SSLError) else ""
            raise TransportError(f"cannot connect to {key}: {exc or 'timed out'}{hint}") from exc
        if self._closed:
            conn.close()
            raise TransportError("request plane client is closed")
        self._conns[key] = conn
        logger.debug("request_plane.tcp.connected address=%s", key)
        return conn

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]

    async def close(self) -> None:
        """Closes every connection; streams still open raise TransportError."""
        self._closed = True
        for task in list(self._connecting.values()):
            task.cancel()
        for conn in list(self._conns.values()):
            conn._fail(TransportError("request plane client closed"))
        self._conns.clear()
