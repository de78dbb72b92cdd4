"""NATS request-plane client: streams over one lazily opened NATS connection per process.

Each stream gets its own reply inbox under one wildcard subscription, so a stream costs no
subscription round trip. Responses must arrive with consecutive sequence numbers; a gap, a "no
responders" status (nobody serves the subject any more) or a stream silent for several heartbeats
raises TransportError, the same signal the TCP plane gives for a lost connection.

The heartbeats come from a timer on the serving process's event loop, so a server that is frozen
(SIGSTOP) or whose loop hangs falls silent like a dead one and its streams fail within
``silence_timeout_s`` (the request plane's heartbeat timeout), while a long prefill that yields
nothing keeps its stream: the server loop still sends heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

import msgspec
from msgspec import UNSET

from dynamod.shared.errors import FrameTooLargeError, ProtocolError, TransportError, error_from_wire
from dynamod.shared.security.settings import NatsSecurity, RequestPlaneSecurity
from dynamod.shared.transport import nats_wire as wire
from dynamod.shared.transport.client_stream import ClientStream, StreamingClient
from dynamod.shared.transport.framing import DEFAULT_WINDOW_FRAMES
from dynamod.shared.transport.liveness import RequestPlaneMetrics
from dynamod.shared.transport.plane import DEFAULT_MAX_FRAME_BYTES, ServerAddress

logger = logging.getLogger(__name__)

_NO_RESPONDERS = "503"


class NatsClientStream(ClientStream):
    """One request over NATS."""

    __slots__ = ("_expected_seq", "_granted", "_last_rx", "_watchdog", "inbox")
    _client: NatsRequestClient

    def __init__(self, *request: Any) -> None:
        """``ClientStream``'s arguments (``StreamingClient.stream`` passes them)."""
        super().__init__(*request)
        self.inbox = ""
        self._expected_seq = 1
        self._granted = self.window
        self._last_rx = 0.0
        self._watchdog: asyncio.TimerHandle | None = None

    async def _open(self) -> None:
        client = self._client
        await client.ensure_connected()
        req = wire.NatsRequest(
            self._endpoint,
            headers=self._headers if self._headers else UNSET,
            body=self._body,
            request_id=self._request_id if self._request_id is not None else UNSET,
            timeout_s=float(self.timeout_s) if self.timeout_s is not None else UNSET,
            credit=self.window,
            heartbeat_s=client.heartbeat_s,
            auth=client.token if client.token is not None else UNSET,
        )
        try:
            payload = wire.encoder.encode(req)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise ProtocolError(f"request body cannot be encoded as msgpack: {exc}") from exc
        limit = client.payload_limit()
        if len(payload) > limit:
            raise FrameTooLargeError(f"request of {len(payload)} bytes exceeds the maximum of {limit} bytes")
        self._sid, self.inbox = client.register(self)
        self._last_rx = time.monotonic()
        self._arm_watchdog(client.silence_timeout_s)
        self._body = None
        try:
            await client.publish(
                wire.endpoint_subject(self.address.address, self._endpoint), payload, reply=self.inbox
            )
        except BaseException:
            client.unregister(self._sid, self)
            self._stop_watchdog()
            raise

    # -- frames in (called by the client's inbox subscription) --------------------------------

    def on_message(self, msg: Any) -> None:
        self._last_rx = time.monotonic()
        headers = msg.headers
        if headers and headers.get("Status") == _NO_RESPONDERS:
            self._lost(TransportError(f"no server answers at {self.address.address} (no responders)"))
            return
        try:
            resp = wire.response_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._lost(ProtocolError(f"malformed response: {exc}"))
            return
        if resp.hb is True:
            # Answer every heartbeat with the credit total: it tells the server this reader is
            # alive, and repairs a credit message NATS may have dropped.
            if not self._done:
                self._client.send_control(self.address, wire.NatsControl(self.inbox, credit=self._granted))
            return
        if resp.seq != self._expected_seq:
            self._lost(
                TransportError(
                    f"response {resp.seq} arrived when {self._expected_seq} was expected: messages were lost"
                )
            )
            return
        self._expected_seq += 1
        if resp.data is not UNSET:
            self.push_data(resp.data)
        elif resp.end is True:
            self._client.unregister(self._sid, self)
            self.push_end()
        elif resp.error is not UNSET:
            self._client.unregister(self._sid, self)
            self.push_error(error_from_wire(resp.error))  # type: ignore[arg-type]

    def _lost(self, exc: BaseException) -> None:
        """The stream cannot continue: tell the server (if it is still there) and fail."""
        if self._done:
            return
        self._send_cancel()
        self.push_error(exc)

    # -- liveness -----------------------------------------------------------------------------

    def _arm_watchdog(self, delay: float) -> None:
        loop = self._loop or asyncio.get_running_loop()
        self._watchdog = loop.call_later(delay, _watchdog_fired, weakref.ref(self))

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _check_alive(self) -> None:
        self._watchdog = None
        if self._done or self._finished:
            return
        allowed = self._client.silence_timeout_s
        silent = time.monotonic() - self._last_rx
        if silent >= allowed:
            logger.warning(
                "request_plane.nats.peer_dead server=%s request_id=%s silent_s=%.1f timeout_s=%.1f",
                self.address.address,
                self._request_id,
                silent,
                allowed,
            )
            if self._client.metrics is not None:
                self._client.metrics.peer_dead("nats")
            self._lost(
                TransportError(f"server at {self.address.address} silent for {silent:.1f}s: presumed lost")
            )
        else:
            self._arm_watchdog(allowed - silent)

    def _finish(self) -> None:
        super()._finish()
        self._stop_watchdog()

    # -- frames out ---------------------------------------------------------------------------

    def _send_grant(self, frames: int) -> None:
        self._granted += frames
        self._client.send_control(self.address, wire.NatsControl(self.inbox, credit=self._granted))

    def _send_cancel(self) -> None:
        self._stop_watchdog()
        self._client.unregister(self._sid, self)
        self._client.send_control(self.address, wire.NatsControl(self.inbox, cancel=True))


def _watchdog_fired(ref: weakref.ref[NatsClientStream]) -> None:
    stream = ref()
    if stream is not None:
        stream._check_alive()


class NatsRequestClient(StreamingClient[NatsClientStream]):
    """Opens request streams to NATS request-plane servers. ``connection`` lets a process share
    one NATS connection; otherwise the client connects to ``nats_url`` on first use."""

    stream_class = NatsClientStream

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
        heartbeat_s: float = wire.DEFAULT_HEARTBEAT_S,
        silence_timeout_s: float | None = None,
        connection: Any = None,
        metrics: RequestPlaneMetrics | None = None,
        security: RequestPlaneSecurity | None = None,
        nats_security: NatsSecurity | None = None,
    ) -> None:
        self.token = security.token.value if security is not None and security.token is not None else None
        self._nats_security = nats_security
        self.nats_url = wire.resolve_nats_url(nats_url)
        self.max_frame_bytes = max_frame_bytes
        self.window_frames = window_frames
        self.heartbeat_s = heartbeat_s
        # How long a stream may hear nothing (not even a server heartbeat) before it is lost.
        self.silence_timeout_s = (
            silence_timeout_s if silence_timeout_s is not None else heartbeat_s * wire.MISSED_HEARTBEATS
        )
        self.metrics = metrics
        self._nc = connection
        self._owns_connection = connection is None
        self._inbox_prefix = ""
        self._sub: Any = None
        self._connecting: asyncio.Task[None] | None = None
        # Weak references: a stream its reader dropped is collected and its finalizer cancels it.
        self._streams: dict[int, weakref.ref[NatsClientStream]] = {}
        self._next_sid = 1
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- connection ---------------------------------------------------------------------------

    async def ensure_connected(self) -> None:
        if self._closed:
            raise TransportError("request plane client is closed")
        if self._sub is not None:
            return
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
            # Retrieved here so an attempt whose waiters were all cancelled is not reported as unhandled.
            self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(self._connecting)

    async def _connect(self) -> None:
        if self._nc is None:
            self._nc = await wire.connect(
                self.nats_url, name="dynamod-rp-client", closing=lambda: self._closed, security=self._nats_security
            )
        self._inbox_prefix = self._nc.new_inbox()
        try:
            self._sub = await self._nc.subscribe(f"{self._inbox_prefix}.*", cb=self._on_message)
        except Exception as exc:  # noqa: BLE001 - nats-py's errors become ours at this boundary
            raise TransportError(f"cannot subscribe to reply inboxes: {exc or type(exc).__name__}") from exc
        logger.debug("request_plane.nats.client_connected url=%s", self.nats_url)

    def payload_limit(self) -> int:
        server_max = self._nc.max_payload if self._nc is not None else self.max_frame_bytes
        return min(self.max_frame_bytes, server_max)

    def register(self, stream: NatsClientStream) -> tuple[int, str]:
        sid = self._next_sid
        self._next_sid = sid + 1
        self._streams[sid] = weakref.ref(stream)
        return sid, f"{self._inbox_prefix}.{sid}"

    def unregister(self, sid: int, stream: NatsClientStream) -> None:
        self._streams.pop(sid, None)  # stream ids are never reused: the entry is this stream's

    async def _on_message(self, msg: Any) -> None:
        subject: str = msg.subject
        try:
            sid = int(subject[len(self._inbox_prefix) + 1 :])
        except ValueError:
            return
        ref = self._streams.get(sid)
        if ref is not None and (stream := ref()) is not None:
            stream.on_message(msg)

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, subject: str, payload: bytes, *, reply: str = "") -> None:
        nc = self._nc
        if nc is None or nc.is_closed:
            raise TransportError("NATS connection of the request-plane client is closed")
        try:
            await nc.publish(subject, payload, reply=reply)
        except Exception as exc:  # noqa: BLE001 - nats-py's errors become ours at this boundary
            raise TransportError(f"NATS publish to {subject} failed: {exc or type(exc).__name__}") from exc

    def send_control(self, address: ServerAddress, ctl: wire.NatsControl) -> None:
        """Fire-and-forget control message (credit, cancel) from synchronous code."""
        payload = wire.encoder.encode(ctl)
        task = asyncio.get_running_loop().create_task(
            self._publish_quietly(wire.control_subject(address.address), payload)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_quietly(self, subject: str, payload: bytes) -> None:
        try:
            await self.publish(subject, payload)
        except TransportError as exc:
            logger.debug("request_plane.nats.control_dropped subject=%s reason=%s", subject, exc)

    async def close(self) -> None:
        """Fails open streams with TransportError and closes an owned connection."""
        self._closed = True
        refs = list(self._streams.values())
        self._streams.clear()
        for ref in refs:
            stream = ref()
            if stream is not None:
                stream.push_error(TransportError("request plane client closed"))
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._background:
            await asyncio.wait(set(self._background), timeout=1.0)
        nc = self._nc
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection may already be closed
                logger.debug("request_plane.nats.unsubscribe_failed reason=%s", exc)
            self._sub = None
        if nc is not None and self._owns_connection and not nc.is_closed:
            await nc.close()
