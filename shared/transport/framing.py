"""Frames of the TCP request plane and their length-prefixed msgpack encoding.

A frame on the wire is ``u32 big-endian length ++ msgpack map``. The map's keys are the names in
DESIGN.md, so other implementations can speak the protocol from the design card alone:

- client -> server, ``ClientFrame``:
  - request ``{stream_id, endpoint, headers, body, request_id?, timeout_s?, credit}``;
  - window update ``{stream_id, credit}`` (the client read ``credit`` more frames of the stream);
  - cancel ``{stream_id, cancel: true}``;
  - ping ``{stream_id: 0, ping: n}`` (connection heartbeat, see below);
  - hello ``{stream_id: 0, auth: token}``: the cluster token, the first frame on a connection to a
    server that requires one (see below).
- server -> client, ``ServerFrame``: ``{stream_id, data}``, ``{stream_id, error}`` or
  ``{stream_id, end: true}``; pong ``{stream_id: 0, pong: n}`` answers ping ``n``. ``stream_id`` 0
  is the connection itself: an error there means the server is about to close the connection
  (oversize or unreadable frame), or, before any pong, that the server predates the heartbeat.

Heartbeat: while a connection has open streams the client pings it every interval (about 20 bytes
on the wire) and the server's event loop answers at once. Any byte from the server counts as life,
so a busy stream needs no pong to stay up; a connection silent for the heartbeat timeout is
declared dead and its streams fail as if it had dropped. This catches what TCP keep-alive cannot:
a frozen (SIGSTOP) or hung server process whose kernel still acknowledges everything. A long
prefill that yields nothing for minutes is not silent: the server loop still answers pings.
Compatibility: a server never sends a pong unasked, so an old client is unaffected; an old server
answers a ping with a connection-level ``protocol_error`` (and keeps the connection), which tells
the client to stop pinging that connection and fall back to TCP keep-alive alone.

Authentication: a server configured with a cluster token reads the first frame of a connection
before anything else, with a limit of ``HELLO_MAX_BYTES``; unless it is a hello whose token matches
(constant-time compare) the server answers a connection-level ``unauthenticated`` error and closes,
having dispatched nothing. The client sends its hello from ``connection_made``, so its requests may
follow at once without waiting for a round trip. A server without a token ignores a hello. With
TLS on, all of this runs inside the TLS session.

Flow control is per stream and counted in frames: the request grants ``credit`` data frames and the
client grants more as its reader consumes them, so neither side buffers more than the window of a
stream however slow its reader is, and a slow stream never blocks the connection for the others.

Absent keys decode as ``msgspec.UNSET``, which keeps ``data: null`` (a handler yielding ``None``)
distinct from "no data".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from dynamod.shared.errors import (
    FrameTooLargeError,
    ProtocolError,
)

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
_HEADER_PLACEHOLDER = bytes(HEADER_SIZE)

CONNECTION_STREAM_ID = 0
"""Stream id of connection-level frames: heartbeats, and errors sent before the server closes a
connection."""

DEFAULT_WINDOW_FRAMES = 128
"""Data frames a stream may have in flight before the server waits for the client's reader."""

MAX_WINDOW_FRAMES = 4096
"""The largest initial window a server accepts, so one request cannot ask for unbounded buffering."""

HELLO_MAX_BYTES = 4096
"""The largest first frame a token-protected server reads from a peer it does not know yet, so an
unauthenticated peer cannot make it buffer a frame of the full request size."""


class ClientFrame(msgspec.Struct, gc=False):
    """A frame from client to server: a request, a window update or a cancel.

    ``gc=False``: frames are short-lived leaves, never part of a reference cycle, so the garbage
    collector need not track them on the hot path.
    """

    stream_id: int
    endpoint: str | UnsetType = UNSET
    headers: dict[str, str] | UnsetType = UNSET
    body: Any = UNSET
    request_id: str | UnsetType = UNSET
    timeout_s: float | UnsetType = UNSET
    credit: int | UnsetType = UNSET
    cancel: bool | UnsetType = UNSET
    ping: int | UnsetType = UNSET
    auth: str | UnsetType = UNSET


class ServerFrame(msgspec.Struct, gc=False):
    """A frame from server to client: one response body, the stream's error, its end, or a pong."""

    stream_id: int
    data: Any = UNSET
    error: dict[str, Any] | UnsetType = UNSET
    end: bool | UnsetType = UNSET
    pong: int | UnsetType = UNSET


@dataclass(frozen=True, slots=True)
class MalformedFrame:
    """A frame whose length was fine but whose payload did not decode as the expected map.

    ``stream_id`` is recovered when the payload is a map with an integer ``stream_id``, so the
    reply can fail just that stream.
    """

    stream_id: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class OversizeFrame:
    """A length prefix over the reader's limit. The byte stream cannot be trusted after it."""

    size: int
    limit: int


_T = TypeVar("_T", ClientFrame, ServerFrame)

_COPY_BELOW = 16 * 1024  # frames smaller than this are sliced (copied); larger ones decoded in place

_encoder = msgspec.msgpack.Encoder()


def append_frame(buf: bytearray, frame: msgspec.Struct, max_frame_bytes: int) -> int:
    """Appends ``frame`` with its length prefix to ``buf`` and returns the payload size.

    Encodes straight into the connection's write buffer (no intermediate bytes object). On failure
    ``buf`` is left as it was, so a bad frame never corrupts the frames queued before it.
    Raises FrameTooLargeError over ``max_frame_bytes`` and ProtocolError when a value cannot be
    encoded as msgpack.
    """
    start = len(buf)
    buf += _HEADER_PLACEHOLDER
    try:
        _encoder.encode_into(frame, buf, start + HEADER_SIZE)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        del buf[start:]
        raise ProtocolError(f"frame cannot be encoded as msgpack: {exc}") from exc
    size = len(buf) - start - HEADER_SIZE
    if size > max_frame_bytes:
        del buf[start:]
        raise FrameTooLargeError(f"frame of {size} bytes exceeds the maximum of {max_frame_bytes} bytes")
    HEADER.pack_into(buf, start, size)
    return size


def encode_frame(frame: msgspec.Struct, max_frame_bytes: int) -> bytes:
    """One frame with its length prefix, as bytes (tests and one-off writers)."""
    buf = bytearray()
    append_frame(buf, frame, max_frame_bytes)
    return bytes(buf)


class FrameReader(Generic[_T]):
    """Incremental decoder: feed it the bytes as they arrive, get back the complete frames.

    Large frames are decoded in place (no copy); only a partial tail is kept between calls. After an oversize length prefix the reader is ``broken`` and ignores further input, since
    the frame boundaries are lost.
    """

    __slots__ = ("_buf", "_decoder", "_max", "broken")

    def __init__(self, frame_type: type[_T], max_frame_bytes: int) -> None:
        self._decoder = msgspec.msgpack.Decoder(frame_type)
        self._buf = bytearray()
        self._max = max_frame_bytes
        self.broken = False

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray) -> list[_T | MalformedFrame | OversizeFrame]:
        out: list[_T | MalformedFrame | OversizeFrame] = []
        if self.broken or not data:
            return out
        buf = self._buf
        if buf:
            buf += data
            data = buf
        n = len(data)
        pos = 0
        decode = self._decoder.decode
        unpack = HEADER.unpack_from
        limit = self._max
        view: memoryview | None = None
        payload: bytes | bytearray | memoryview | None = None
        while n - pos >= HEADER_SIZE:
            (size,) = unpack(data, pos)
            if size > limit:
                out.append(OversizeFrame(size, limit))
                self.broken = True
                pos = n
                break
            start = pos + HEADER_SIZE
            end = start + size
            if end > n:
                break
            if size < _COPY_BELOW:
                payload = data[start:end]  # copying a small frame is cheaper than a memoryview
            else:
                if view is None:
                    view = memoryview(data)
                payload = view[start:end]
            try:
                out.append(decode(payload))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                out.append(_malformed(payload, exc))
            pos = end
        if view is not None:
            payload = None  # drop the last slice so the buffer may be resized
            view.release()
        if data is buf:
            del buf[:pos]
        elif pos < n:
            buf += data[pos:]
        return out


def _malformed(payload: bytes | bytearray | memoryview, exc: Exception) -> MalformedFrame:
    stream_id: int | None = None
    try:
        loose = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError):
        loose = None
    if isinstance(loose, dict):
        sid = loose.get("stream_id")
        if isinstance(sid, int) and not isinstance(sid, bool) and sid > 0:
            stream_id = sid
    return MalformedFrame(stream_id, str(exc))
