"""The reading half of our TCP KV block transport: pooled connections that receive block bytes
straight into the reader's own rows.

``KvReadConnection`` is an ``asyncio.BufferedProtocol``: the event loop asks it for a buffer before
every ``recv``, and while a ``data`` reply's bytes arrive it hands out views of the destination
rows, so the kernel copies them into place and nothing else touches them. Header frames are read
exactly (length first, then the body), so payload bytes never land in a scratch buffer.

Where the bytes go is fixed before the request is sent: the loop may ask for the next buffer before
the coroutine that sent the request runs again. A streamed read's reply comes as several ``data``
frames, each announcing the next part of the bytes (``tcp_wire``); they fill the same rows in order,
and an ``error`` frame in place of the next part ends the read with the server's reason.

Credentials (``ClientCredentials``, the request plane's): with TLS configured every connection is
dialled over TLS against the cluster CA; with a cluster token each new connection first sends a
``hello`` with it and waits for ``ok``. A refusal is a ``KvTransferError`` that says so (not worth
retrying on another connection: the same credentials would be refused again).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import cast

import msgspec

from dynamod.shared.kv.transfer.base import KvTransferError
from dynamod.shared.kv.transfer.tcp_wire import (
    LENGTH,
    LENGTH_SIZE,
    MAX_FRAME_BYTES,
    DataReply,
    ErrorReply,
    HelloRequest,
    OkReply,
    Reply,
    encode_frame,
    reply_decoder,
    split_address,
)
from dynamod.shared.transport.guard import DEFAULT_HANDSHAKE_TIMEOUT_S, ClientCredentials

logger = logging.getLogger(__name__)

_IDLE, _LENGTH, _BODY, _PAYLOAD = range(4)

MAX_IDLE_PER_ADDRESS = 4
"""Idle connections kept per remote agent; more concurrent reads dial more and close the extra."""


class KvReadConnection(asyncio.BufferedProtocol):
    """One connection to a remote block server; one request in flight at a time."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False
        self.received_bytes = 0  # payload bytes of the current request
        self.expected_bytes = 0
        self._transport: asyncio.Transport | None = None
        self._state = _IDLE
        self._length = bytearray(LENGTH_SIZE)
        self._body = bytearray()
        self._filled = 0  # of the header being read
        self._targets: list[memoryview] = []
        self._target_index = 0
        self._target_filled = 0  # bytes of the current target already received
        self._segment_left = 0  # payload bytes the last ``data`` frame announced, still to come
        self.last_heard = 0.0  # time.monotonic() of the last bytes received
        self._reply: asyncio.Future[Reply] | None = None
        self._is_read = False
        self._pending_data: DataReply = DataReply(0, 0)
        self._scratch = bytearray(256)

    # -- asyncio protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Duck-typed: uvloop's TCPTransport has the Transport methods without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        state = self._state
        if state == _PAYLOAD:
            start = self._target_filled
            return self._targets[self._target_index][start : start + self._segment_left]
        if state == _LENGTH:
            return memoryview(self._length)[self._filled :]
        if state == _BODY:
            return memoryview(self._body)[self._filled :]
        return memoryview(self._scratch)  # bytes nobody asked for: reported in buffer_updated

    def buffer_updated(self, nbytes: int) -> None:
        self.last_heard = time.monotonic()
        state = self._state
        if state == _PAYLOAD:
            self.received_bytes += nbytes
            self._segment_left -= nbytes
            self._target_filled += nbytes
            if self._target_filled == len(self._targets[self._target_index]):
                self._target_index += 1
                self._target_filled = 0
            if self._segment_left == 0:
                if self.received_bytes == self.expected_bytes:
                    self._finish(self._pending_data)
                else:  # a streamed read: the next part's frame follows
                    self._state = _LENGTH
                    self._filled = 0
            return
        self._filled += nbytes
        if state == _LENGTH:
            if self._filled == LENGTH_SIZE:
                (length,) = LENGTH.unpack(self._length)
                if not 0 < length <= MAX_FRAME_BYTES:
                    self._fail(
                        KvTransferError(f"KV block server {self.address} sent a frame of {length} bytes")
                    )
                    return
                self._body = bytearray(length)
                self._filled = 0
                self._state = _BODY
        elif state == _BODY:
            if self._filled == len(self._body):
                self._on_reply_frame()
        else:
            self._fail(
                KvTransferError(f"KV block server {self.address} sent {nbytes} bytes nobody asked for")
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._reply is not None and not self._reply.done():
            detail = f"received {self.received_bytes} of {self.expected_bytes} block bytes"
            reason = f": {exc}" if exc else ""
            self._reply.set_exception(
                KvTransferError(f"KV block server {self.address} went away mid-transfer ({detail}){reason}")
            )

    # -- requests -----------------------------------------------------------------------------

    async def request(self, frame: bytes, targets: list[memoryview] | None = None) -> Reply:
        """Sends one request frame; for a read, ``targets`` are the local rows (in order) that
        the reply's bytes go into. Returns the reply (``ErrorReply`` included)."""
        if self.closed or self._transport is None:
            raise KvTransferError(f"connection to KV block server {self.address} is closed")
        if self._state != _IDLE:
            raise RuntimeError("KvReadConnection carries one request at a time")
        self._targets = targets if targets is not None else []
        self._is_read = targets is not None
        self.expected_bytes = sum(len(t) for t in self._targets)
        self.received_bytes = 0
        self._target_index = 0
        self._target_filled = 0
        self._segment_left = 0
        self._filled = 0
        self._state = _LENGTH
        self._reply = asyncio.get_running_loop().create_future()
        self._transport.write(frame)
        try:
            return await self._reply
        finally:
            self._reply = None
            self._targets = []

    def abort(self) -> None:
        """Drops the connection at once (a timed-out or cancelled request left it mid-stream)."""
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    # -- internals ----------------------------------------------------------------------------

    def _on_reply_frame(self) -> None:
        try:
            reply = reply_decoder.decode(self._body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._fail(KvTransferError(f"KV block server {self.address} sent a malformed reply: {exc}"))
            return
        if isinstance(reply, DataReply):
            announced = reply.num_blocks * reply.block_bytes
            left = self.expected_bytes - self.received_bytes
            if announced == 0 and left > 0 and self._is_read:  # a streamed read's heartbeat
                self._filled = 0
                self._state = _LENGTH
                return
            if not self._is_read or announced > left or announced < 0:
                self._fail(
                    KvTransferError(
                        f"KV block server {self.address} announced {announced} block bytes, "
                        f"expected {left} more"
                    )
                )
                return
            self._pending_data = reply
            self._filled = 0
            if announced == 0:
                self._finish(reply)
            else:
                self._segment_left = announced
                self._state = _PAYLOAD
            return
        if isinstance(reply, OkReply) and self._is_read:
            self._fail(KvTransferError(f"KV block server {self.address} answered a read with 'ok'"))
            return
        self._finish(reply)

    def _finish(self, reply: Reply) -> None:
        self._state = _IDLE
        self._filled = 0
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(reply)

    def _fail(self, exc: KvTransferError) -> None:
        self._state = _IDLE
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(exc)
        self.abort()


class KvConnectionPool:
    """Idle connections per remote address. A connection that failed or timed out is never put
    back (its stream position is unknown); the next read dials again."""

    def __init__(self, credentials: ClientCredentials | None = None) -> None:
        self._idle: dict[str, list[KvReadConnection]] = {}
        self._credentials = credentials or ClientCredentials(None)

    async def acquire(self, address: str) -> tuple[KvReadConnection, bool]:
        """An open connection to ``address`` and whether it was reused from the pool."""
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        return await self.dial(address), False

    async def dial(self, address: str) -> KvReadConnection:
        try:
            host, port = split_address(address)
        except ValueError as exc:
            raise KvTransferError(str(exc)) from exc
        loop = asyncio.get_running_loop()
        tls = self._credentials.ssl_context
        try:
            _, conn = await loop.create_connection(
                lambda: KvReadConnection(address),
                host,
                port,
                ssl=tls,
                server_hostname=host if tls is not None else None,
                ssl_handshake_timeout=DEFAULT_HANDSHAKE_TIMEOUT_S if tls is not None else None,
            )
        except ssl.SSLError as exc:
            raise KvTransferError(
                f"TLS with KV block server {address} failed: {exc.reason or exc} "
                "(check --tls-ca-file and the server's certificate)"
            ) from exc
        except OSError as exc:
            raise KvTransferError(f"cannot connect to KV block server {address}: {exc}") from exc
        if self._credentials.token is not None:
            await self._hello(conn)
        return conn

    async def _hello(self, conn: KvReadConnection) -> None:
        """Presents the cluster token; a refusal closes the connection and says why."""
        try:
            reply = await conn.request(encode_frame(HelloRequest(self._credentials.token)))
        except BaseException:
            conn.abort()
            raise
        if isinstance(reply, ErrorReply):
            conn.abort()
            raise KvTransferError(
                f"KV block server {conn.address} refused this worker ({reply.code}): {reply.message}"
            )
        if not isinstance(reply, OkReply):
            conn.abort()
            raise KvTransferError(f"KV block server {conn.address} answered hello with {reply!r}")

    def release(self, conn: KvReadConnection) -> None:
        if conn.closed:
            return
        idle = self._idle.setdefault(conn.address, [])
        if len(idle) >= MAX_IDLE_PER_ADDRESS:
            conn.abort()
            return
        idle.append(conn)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
