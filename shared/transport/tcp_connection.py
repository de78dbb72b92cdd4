"""What both ends of a TCP request-plane connection share: TCP_NODELAY, TCP keep-alive (a dead
peer's connection fails within seconds), socket buffer limits and batched frame writes.

Frames are encoded straight into one write buffer and flushed once per event-loop pass (or as
soon as the buffer passes ``FLUSH_BYTES``), so a burst of frames from several streams leaves in a
single ``write`` call instead of one system call per token.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import msgspec

from dynamod.shared.errors import TransportError
from dynamod.shared.transport.framing import append_frame
from dynamod.shared.transport.tls_session import ServerTlsSession

logger = logging.getLogger(__name__)

FLUSH_BYTES = 256 * 1024  # flush at once past this much queued output
WRITE_HIGH_WATER = 1024 * 1024  # socket buffer size at which ``pause_writing`` fires
WRITE_LOW_WATER = 256 * 1024


KEEPALIVE_IDLE_S = 5  # silence before the kernel starts probing the peer
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3  # a powered-off or cut-off peer is declared dead after about 11 s


def tune_socket(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY: a token frame must leave now, not after the peer's delayed ACK.
    Keep-alive probes: a peer whose node died or whose link was cut never closes the connection, so
    without them a stream to it would wait forever instead of failing (and being migrated). (A
    frozen process is not caught this way: its kernel still answers the probes.)"""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    except OSError as exc:
        logger.debug("request_plane.socket_options_failed reason=%s", exc)


class FrameConnection(asyncio.Protocol):
    """Base protocol: owns the transport and the batched write path; subclasses read frames."""

    def __init__(self, max_frame_bytes: int, peer: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._max = max_frame_bytes
        self._wbuf = bytearray()
        self._flush_scheduled = False
        self._transport: asyncio.Transport | None = None
        self.peer = peer
        self.paused = False
        self.closed = False
        self.tls: ServerTlsSession | None = None  # set by a TLS server connection: writes are encrypted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, so no isinstance check here.
        self._transport = transport  # type: ignore[assignment]
        tune_socket(transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)  # type: ignore[attr-defined]

    def write_frame(self, frame: msgspec.Struct) -> None:
        """Queues one frame for the next flush. Raises FrameTooLargeError or ProtocolError when the
        frame cannot be sent (what was queued before stays intact), TransportError when closed."""
        if self.closed:
            raise TransportError(f"connection to {self.peer} is closed")
        buf = self._wbuf
        append_frame(buf, frame, self._max)
        if len(buf) >= FLUSH_BYTES:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush_soon(self) -> None:
        """Schedules a flush now, so it runs after callbacks already queued in this loop pass."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        data = self._wbuf
        if not data:
            return
        # Hand the whole buffer over and start a fresh one: the transport may keep a reference to
        # what it could not send yet, so the old buffer must never be mutated again.
        self._wbuf = bytearray()
        transport = self._transport
        if transport is not None and not self.closed and not transport.is_closing():
            transport.write(data if self.tls is None else self.tls.send(data))

    @property
    def write_buffer_bytes(self) -> int:
        """Bytes queued on this connection and not yet taken by the kernel."""
        transport = self._transport
        pending = (
            transport.get_write_buffer_size() if transport is not None and not transport.is_closing() else 0
        )
        return pending + len(self._wbuf)

    def close_transport(self) -> None:
        """Flushes what is queued, then closes (the transport sends its buffer before closing)."""
        self.flush()
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if self.tls is not None:
                transport.write(self.tls.close_notify())
            transport.close()
