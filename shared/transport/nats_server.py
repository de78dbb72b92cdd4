"""NATS request-plane server: endpoints of this process behind subjects of one NATS connection.

One wildcard subscription takes every request for this server (``B.rq.>``) and one takes control
messages (``B.ctl``); the endpoint is read from the request, so ``register``/``unregister`` need no
subscription changes and an unknown endpoint gets NotFoundError instead of silence. Responses are
published to the request's reply inbox with sequence numbers, paced by the client's credit, with
heartbeats on quiet streams.

Only NATS users reach these subjects (NATS's own auth); with a cluster token each request must
also carry it, checked before the endpoint is looked up (``ServerGuard``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import msgspec
from msgspec import UNSET

from dynamod.shared.errors import (
    DynamoError,
    FrameTooLargeError,
    ProtocolError,
    TransportError,
    error_to_wire,
)
from dynamod.shared.security.settings import NatsSecurity, RequestPlaneSecurity
from dynamod.shared.transport import nats_wire as wire
from dynamod.shared.transport.framing import DEFAULT_WINDOW_FRAMES, MAX_WINDOW_FRAMES
from dynamod.shared.transport.guard import ServerGuard
from dynamod.shared.transport.liveness import RequestPlaneMetrics
from dynamod.shared.transport.plane import DEFAULT_MAX_FRAME_BYTES, RequestContext, ServerAddress
from dynamod.shared.transport.server_stream import ServerStream, ServesFromState, ServingState

logger = logging.getLogger(__name__)

_MIN_HEARTBEAT_S = 0.05


class _NatsServerStream(ServerStream):
    __slots__ = ("_allowed", "_hb_handle", "_hb_s", "_last_tx", "_seq", "_unanswered_hb", "inbox", "server")

    def __init__(
        self, server: NatsRequestServer, inbox: str, ctx: RequestContext, credit: int, heartbeat_s: float
    ) -> None:
        super().__init__(ctx, credit)
        self.server = server
        self.inbox = inbox
        self._allowed = credit
        self._seq = 0
        self._hb_s = heartbeat_s
        self._last_tx = time.monotonic()
        self._unanswered_hb = 0
        self._hb_handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            heartbeat_s, self._heartbeat
        )

    def client_alive(self) -> None:
        """Any control message from the client proves it is still there."""
        self._unanswered_hb = 0

    def _peer_gone(self) -> bool:
        return self.server.connection_closed()

    def allow_total(self, total: int) -> None:
        """Credit from the client as a running total of data messages it lets us send."""
        if total > self._allowed:
            self.add_credit(total - self._allowed)
            self._allowed = total

    def _next(self, **fields: Any) -> bytes:
        self._seq += 1
        return wire.encoder.encode(wire.NatsResponse(self._seq, **fields))

    def _write_data(self, item: Any) -> Any:
        return self._publish(self._next(data=item))

    def _write_end(self) -> Any:
        return self._publish(self._next(end=True))

    def _write_error(self, err: dict[str, Any]) -> Any:
        return self._publish(self._next(error=err))

    async def _publish(self, payload: bytes) -> None:
        limit = self.server.payload_limit()
        if len(payload) > limit:
            self._seq -= 1
            raise FrameTooLargeError(f"response of {len(payload)} bytes exceeds the maximum of {limit} bytes")
        self._last_tx = time.monotonic()
        await self.server.publish(self.inbox, payload)

    def _heartbeat(self) -> None:
        self._hb_handle = None
        if self._unanswered_hb >= wire.MISSED_HEARTBEATS:
            # NATS gives no signal when a subscriber dies: a client that stopped answering
            # heartbeats is gone, and its handler must not wait for credit forever.
            logger.info(
                "request_plane.nats.client_gone request_id=%s unanswered_heartbeats=%d",
                self.ctx.request_id,
                self._unanswered_hb,
            )
            self.cancel(None)
            return
        idle = time.monotonic() - self._last_tx
        if idle >= self._hb_s * 0.9:
            self._unanswered_hb += 1
            self._last_tx = time.monotonic()
            self.server.publish_soon(self.inbox, wire.encoder.encode(wire.NatsResponse(0, hb=True)))
            delay = self._hb_s
        else:
            delay = self._hb_s - idle
        self._hb_handle = asyncio.get_running_loop().call_later(delay, self._heartbeat)

    def stop_heartbeat(self) -> None:
        if self._hb_handle is not None:
            self._hb_handle.cancel()
            self._hb_handle = None


class NatsRequestServer(ServesFromState):
    """The NATS request-plane server. ``connection`` lets a process share one NATS connection;
    otherwise the server opens (and closes) its own to ``nats_url``."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        connection: Any = None,
        subject_prefix: str = wire.SUBJECT_PREFIX,
        security: RequestPlaneSecurity | None = None,
        nats_security: NatsSecurity | None = None,
        metrics: RequestPlaneMetrics | None = None,
    ) -> None:
        # TLS of the request plane is the TCP listener's; on NATS the session is NATS's own.
        token = security.token if security is not None else None
        self.guard = ServerGuard(RequestPlaneSecurity(token=token), transport="nats", metrics=metrics)
        self._nats_security = nats_security
        self.nats_url = wire.resolve_nats_url(nats_url)
        self.max_frame_bytes = max_frame_bytes
        self.base = f"{subject_prefix}.{uuid.uuid4().hex[:16]}"
        self._nc = connection
        self._owns_connection = connection is None
        self._state = ServingState()
        self._streams: dict[str, _NatsServerStream] = {}
        self._subs: list[Any] = []
        self._background: set[asyncio.Task[None]] = set()
        self._address: ServerAddress | None = None

    async def start(self) -> ServerAddress:
        if self._address is not None:
            return self._address
        if self._nc is None:
            self._nc = await wire.connect(
                self.nats_url,
                name=f"dynamod-rp-server-{self.base.rsplit('.', 1)[-1]}",
                closing=lambda: self._state.stopping,
                security=self._nats_security,
            )
        self._subs.append(await self._nc.subscribe(f"{self.base}.rq.>", cb=self._on_request))
        self._subs.append(await self._nc.subscribe(wire.control_subject(self.base), cb=self._on_control))
        await self._nc.flush()
        self._address = ServerAddress("nats", self.base)
        logger.info("request_plane.nats.serving url=%s base=%s", self.nats_url, self.base)
        return self._address

    def connection_closed(self) -> bool:
        return self._nc is None or self._nc.is_closed

    def payload_limit(self) -> int:
        nc = self._nc
        server_max = nc.max_payload if nc is not None else self.max_frame_bytes
        return min(self.max_frame_bytes, server_max)

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, subject: str, payload: bytes) -> None:
        nc = self._nc
        if nc is None or nc.is_closed:
            raise TransportError("NATS connection of the request-plane server is closed")
        try:
            await nc.publish(subject, payload)
        except Exception as exc:  # noqa: BLE001 - nats-py's errors become ours at this boundary
            raise TransportError(f"NATS publish to {subject} failed: {exc or type(exc).__name__}") from exc

    def publish_soon(self, subject: str, payload: bytes) -> None:
        """Fire-and-forget publish from a callback (heartbeats, refusals)."""
        task = asyncio.get_running_loop().create_task(self._publish_quietly(subject, payload))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_quietly(self, subject: str, payload: bytes) -> None:
        try:
            await self.publish(subject, payload)
        except TransportError as exc:
            logger.debug("request_plane.nats.publish_dropped subject=%s reason=%s", subject, exc)

    def _refuse(self, inbox: str, exc: DynamoError) -> None:
        self.publish_soon(inbox, wire.encoder.encode(wire.NatsResponse(1, error=error_to_wire(exc))))

    # -- messages in --------------------------------------------------------------------------

    async def _on_request(self, msg: Any) -> None:
        inbox = msg.reply
        if not inbox:
            logger.warning("request_plane.nats.request_without_reply subject=%s", msg.subject)
            return
        if len(msg.data) > self.max_frame_bytes:
            self._refuse(
                inbox, FrameTooLargeError(f"request of {len(msg.data)} bytes exceeds {self.max_frame_bytes}")
            )
            return
        try:
            req = wire.request_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("request_plane.nats.malformed_request subject=%s reason=%s", msg.subject, exc)
            self._refuse(inbox, ProtocolError(f"malformed request: {exc}"))
            return
        reason = self.guard.check_token(req.auth if req.auth is not UNSET else None)  # type: ignore[arg-type]
        if reason is not None:
            self._refuse(inbox, self.guard.reject(inbox.rsplit(".", 1)[0], reason))
            return
        if inbox in self._streams:
            self._refuse(inbox, ProtocolError(f"reply inbox {inbox} is already in use"))
            return
        try:
            handler = self._state.handler_for(req.endpoint)
        except DynamoError as exc:
            self._refuse(inbox, exc)
            return
        timeout = req.timeout_s if req.timeout_s is not UNSET else None
        ctx = RequestContext(
            req.request_id if req.request_id is not UNSET else uuid.uuid4().hex,  # type: ignore[arg-type]
            req.endpoint,
            req.headers if req.headers is not UNSET else {},  # type: ignore[arg-type]
            time.monotonic() + timeout if timeout is not None else None,  # type: ignore[operator]
        )
        credit = req.credit if req.credit is not UNSET else DEFAULT_WINDOW_FRAMES
        heartbeat = req.heartbeat_s if req.heartbeat_s is not UNSET else wire.DEFAULT_HEARTBEAT_S
        stream = _NatsServerStream(
            self,
            inbox,
            ctx,
            min(max(1, credit), MAX_WINDOW_FRAMES),  # type: ignore[type-var]
            max(_MIN_HEARTBEAT_S, heartbeat),  # type: ignore[type-var]
        )
        self._streams[inbox] = stream
        body = req.body if req.body is not UNSET else None
        self._state.start(stream, handler, body, self._on_stream_done)

    def _on_stream_done(self, stream: ServerStream) -> None:
        assert isinstance(stream, _NatsServerStream)
        stream.stop_heartbeat()
        if self._streams.get(stream.inbox) is stream:
            del self._streams[stream.inbox]

    async def _on_control(self, msg: Any) -> None:
        try:
            ctl = wire.control_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("request_plane.nats.malformed_control reason=%s", exc)
            return
        stream = self._streams.get(ctl.inbox)
        if stream is None:
            return
        stream.client_alive()
        if ctl.cancel is True:
            logger.debug("request_plane.nats.cancel_received request_id=%s", stream.ctx.request_id)
            stream.cancel(None)
        elif ctl.credit is not UNSET and ctl.credit > 0:  # type: ignore[operator]
            stream.allow_total(ctl.credit)  # type: ignore[arg-type]

    # -- lifecycle ----------------------------------------------------------------------------

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuses new requests (UnavailableError), lets in-flight streams finish for up to
        ``grace_s``, cancels the rest, then unsubscribes and closes an owned connection."""
        if self._state.stopping and self._address is None:
            return
        inflight = self._state.inflight
        logger.info(
            "request_plane.nats.stopping base=%s inflight=%d grace_s=%s", self.base, inflight, grace_s
        )
        cancelled = await self._state.drain(grace_s)
        nc = self._nc
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection may already be closed
                logger.debug("request_plane.nats.unsubscribe_failed reason=%s", exc)
        self._subs.clear()
        if self._background:
            await asyncio.wait(set(self._background), timeout=1.0)
        if nc is not None and self._owns_connection and not nc.is_closed:
            try:
                await nc.flush(timeout=1)
            except Exception as exc:  # noqa: BLE001 - best effort before close
                logger.debug("request_plane.nats.flush_failed reason=%s", exc)
            await nc.close()
        self._address = None
        logger.info(
            "request_plane.nats.stopped base=%s served_to_end=%d cancelled=%d",
            self.base,
            inflight - cancelled,
            cancelled,
        )
