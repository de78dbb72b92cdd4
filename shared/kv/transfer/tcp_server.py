"""The serving half of our TCP KV block transport: answers reads of one ``KvBlockMemory``.

Every request is validated before a byte of block data is sent (block size, ids, frame size), and a
refused request gets an ``error`` frame that the reader turns into a ``KvTransferError`` with the
same message; the connection stays usable. Block rows go to the socket as views of the array (one
write per run of consecutive ids, in bounded chunks), so the asyncio transport copies only what
the kernel did not take at once, and ``drain`` keeps that bounded.

A read that names an open transfer of the memory's ``readiness`` (``wait_ms > 0``: streamed) may
ask for blocks the engine is still computing: they are sent in order, a ``data`` frame per batch as
they become ready, with heartbeats while none is, and the checksum with the last (``tcp_wire``).

Block bytes are prompt content, so the server admits readers the way the request plane does
(``ServerGuard``, built from the same ``RequestPlaneSecurity``): with TLS configured it serves only
TLS (mutual when client certificates are required), and with a cluster token the first frame of a
connection must be a ``hello`` carrying it; anything else gets one ``unauthenticated`` error frame
and the connection closes, before any block is read. Refusals are counted and logged like the
request plane's (transport ``kv_transfer``). A failed TLS handshake is asyncio's to end and is not
counted (the connection never reaches this code).

Connection slots are the request plane's (``transport/admission``): at most ``max_connections``,
and connections that have not yet presented the token are pending, capped in total and per peer
address, the oldest closed to make room; a reader that proved itself is never pushed out by them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import Callable

import msgspec

from dynamod.shared.kv.transfer.base import KvTransferError, NotifyCallback, deliver_notify
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.readiness import TransferNotReady, TransferProgress
from dynamod.shared.kv.transfer.tcp_wire import (
    HEARTBEAT_S,
    LENGTH,
    LENGTH_SIZE,
    MAX_BLOCKS_PER_READ,
    MAX_FRAME_BYTES,
    MAX_NOTIFY_BYTES,
    MAX_WAIT_MS,
    DataReply,
    ErrorReply,
    HelloRequest,
    NotifyRequest,
    OkReply,
    ReadRequest,
    ReadyReply,
    WatchRequest,
    contiguous_runs,
    encode_frame,
    request_decoder,
)
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.token import REASON_HANDSHAKE_TIMEOUT, REASON_MISSING_TOKEN
from dynamod.shared.transport.admission import ConnectionAdmission, PreAuthLimits
from dynamod.shared.transport.guard import ServerGuard
from dynamod.shared.transport.liveness import RequestPlaneMetrics

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 4 << 20
"""Bytes handed to the transport per write; with a high-water mark of the same size the transport
buffers at most about two chunks per connection."""


GUARD_TRANSPORT = "kv_transfer"  # the transport label of refusals in the request plane's metric
DEFAULT_MAX_CONNECTIONS = 1024


class _Reader:
    """One accepted connection, as the slot table sees it."""

    __slots__ = ("writer", "metrics", "evicted")

    def __init__(self, writer: asyncio.StreamWriter, metrics: RequestPlaneMetrics | None) -> None:
        self.writer = writer
        self.metrics = metrics
        self.evicted = False

    def evict_pending(self, reason: str) -> None:
        self.evicted = True  # counted here; the admission table logs evictions once a minute
        if self.metrics is not None:
            self.metrics.rejected(GUARD_TRANSPORT, f"evicted_{reason}")
        self.writer.transport.abort()


class KvBlockServer:
    """asyncio TCP server of one agent's block memory. ``notify`` messages go to the callback.
    ``security``: who may read (see the module docstring); None or empty: everyone (loopback dev)."""

    def __init__(
        self,
        memory: KvBlockMemory,
        agent_name: str,
        host: str,
        port: int,
        *,
        security: RequestPlaneSecurity | None = None,
        metrics: RequestPlaneMetrics | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pre_auth: PreAuthLimits | None = None,
    ) -> None:
        self._memory = memory
        self._agent_name = agent_name
        self._host = host
        self._port = port
        self.guard = ServerGuard(security, transport=GUARD_TRANSPORT, metrics=metrics)
        self._metrics = metrics
        self.admission = ConnectionAdmission("kv_transfer.tcp", max_connections, pre_auth)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._callback: NotifyCallback | None = None
        self._on_blocks_ready: Callable[[], None] | None = None
        self.bytes_served = 0

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("KV block server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    def set_notify_callback(self, callback: NotifyCallback) -> None:
        self._callback = callback

    def set_blocks_ready_callback(self, callback: Callable[[], None]) -> None:
        """Called when a watch is answered with newly ready blocks: the watcher is about to READ
        them over another channel (NIXL), which may need this side's progress."""
        self._on_blocks_ready = callback

    async def start(self) -> None:
        tls = self.guard.ssl_context
        try:
            self._server = await asyncio.start_server(
                self._serve,
                self._host,
                self._port,
                limit=MAX_FRAME_BYTES,
                ssl=tls,
                ssl_handshake_timeout=self.guard.handshake_timeout_s if tls is not None else None,
            )
        except OSError as exc:
            raise KvTransferError(
                f"KV block server of agent {self._agent_name} cannot listen on {self._host}:{self._port}: "
                f"{exc.strerror or exc}; pick another --kv-transfer-port (0 = any free port)"
            ) from None
        logger.info(
            "kv_transfer.tcp.serving agent=%s host=%s port=%d blocks=%d block_bytes=%d security=%s",
            self._agent_name,
            self._host,
            self.port,
            self._memory.num_blocks,
            self._memory.block_bytes,
            self.guard.describe,
        )

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        for task in list(self._handlers):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        writer.transport.set_write_buffer_limits(high=_CHUNK_BYTES)
        peer = writer.get_extra_info("peername")
        slot = _Reader(writer, self._metrics)
        needs_hello = self.guard.token is not None
        if needs_hello and self.guard.guessing(peer):
            if self._metrics is not None:  # too many wrong tokens from this address: closed unread
                self._metrics.rejected(GUARD_TRANSPORT, "auth_rate_limited")
            writer.transport.abort()
            if task is not None:
                self._handlers.discard(task)
            return
        admitted = self.admission.open(slot, peer) if needs_hello else self.admission.open_established(slot)
        if not admitted:
            logger.warning("kv_transfer.tcp.connection_refused agent=%s peer=%s reason=max_connections", self._agent_name, peer)
            writer.write(encode_frame(ErrorReply("overloaded", "this KV block server holds its maximum of connections")))
            writer.close()
            if task is not None:
                self._handlers.discard(task)
            return
        try:
            if needs_hello:
                if not await self._admit(reader, writer, peer):
                    return
                self.admission.establish(slot)
            while True:
                try:
                    head = await reader.readexactly(LENGTH_SIZE)
                except asyncio.IncompleteReadError:
                    return  # the reader closed its connection between requests
                (length,) = LENGTH.unpack(head)
                if length > MAX_FRAME_BYTES:
                    writer.write(
                        encode_frame(
                            ErrorReply(
                                "frame_too_large",
                                f"request frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}",
                            )
                        )
                    )
                    await writer.drain()
                    return
                body = await reader.readexactly(length)
                try:
                    request = request_decoder.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    writer.write(encode_frame(ErrorReply("protocol_error", f"malformed request: {exc}")))
                    await writer.drain()
                    return
                if isinstance(request, ReadRequest):
                    await self._serve_read(request, writer)
                elif isinstance(request, WatchRequest):
                    await self._serve_watch(request, writer)
                elif isinstance(request, HelloRequest):
                    # Open server, or a repeated hello on an admitted connection: nothing to check.
                    writer.write(encode_frame(OkReply()))
                    await writer.drain()
                else:
                    self._deliver(request)
                    writer.write(encode_frame(OkReply()))
                    await writer.drain()
        except asyncio.CancelledError:
            return  # close() stops the handlers; the stream callback must not see a cancelled task
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            if not slot.evicted:
                logger.info("kv_transfer.tcp.reader_lost agent=%s peer=%s reason=%s", self._agent_name, peer, exc)
        finally:
            self.admission.close(slot)
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object) -> bool:
        """Reads the first frame within the handshake timeout: a ``hello`` with the cluster token
        admits the connection (answered ``ok``); anything else is refused with one error frame."""
        label = _peer_label(peer)
        try:
            async with asyncio.timeout(self.guard.handshake_timeout_s):
                (length,) = LENGTH.unpack(await reader.readexactly(LENGTH_SIZE))
                body = await reader.readexactly(length) if 0 < length <= MAX_FRAME_BYTES else b""
        except TimeoutError:
            self.guard.reject(label, REASON_HANDSHAKE_TIMEOUT, "no hello frame in time")
            return False
        try:
            request = request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            request = None
        if isinstance(request, HelloRequest):
            reason = self.guard.check_token(request.auth)
        else:
            reason = REASON_MISSING_TOKEN
        if reason is None:
            writer.write(encode_frame(OkReply()))
            await writer.drain()
            return True
        error = self.guard.reject(label, reason, "kv block server")
        writer.write(encode_frame(ErrorReply("unauthenticated", error.message)))
        await writer.drain()
        return False

    def _unknown(self, transfer_id: str) -> str:
        reason = self._memory.readiness.ended(transfer_id)
        if reason is not None:
            return f"transfer {transfer_id} failed: {reason}"
        return (
            f"agent {self._agent_name} has no open transfer {transfer_id!r} "
            "(its prefill was aborted, or its blocks were released or expired)"
        )

    def _refusal(self, request: ReadRequest | WatchRequest) -> str | None:
        memory = self._memory
        if request.block_bytes != memory.block_bytes:
            return (
                f"block size mismatch: the reader's blocks are {request.block_bytes} bytes, agent "
                f"{self._agent_name}'s are {memory.block_bytes}; both workers must serve the same model "
                "with the same block size and dtype"
            )
        if len(request.block_ids) > MAX_BLOCKS_PER_READ:
            return f"read of {len(request.block_ids)} blocks is over the limit of {MAX_BLOCKS_PER_READ}"
        bad = [b for b in request.block_ids if not 0 <= b < memory.num_blocks]
        if bad:
            return (
                f"block ids {bad[:8]} are outside agent {self._agent_name}'s [0, {memory.num_blocks}) "
                "(stale transfer parameters, or a restarted prefill worker)"
            )
        return None

    async def _serve_read(self, request: ReadRequest, writer: asyncio.StreamWriter) -> None:
        refusal = self._refusal(request)
        if refusal is not None:
            logger.info("kv_transfer.tcp.read_refused agent=%s reason=%r", self._agent_name, refusal)
            writer.write(encode_frame(ErrorReply("invalid_read", refusal)))
            await writer.drain()
            return
        progress = self._memory.readiness.get(request.transfer_id) if request.transfer_id else None
        if progress is None and request.wait_ms > 0:
            # A streamed read names a transfer this engine opened; gone means aborted or released.
            writer.write(encode_frame(ErrorReply("unknown_transfer", self._unknown(request.transfer_id))))
            await writer.drain()
            return
        if progress is None:
            writer.write(encode_frame(DataReply(len(request.block_ids), self._memory.block_bytes)))
            await self._send_rows(request.block_ids, writer)
            return
        await self._serve_streamed(request, progress, writer)

    async def _serve_streamed(self, request: ReadRequest, progress: TransferProgress, writer: asyncio.StreamWriter) -> None:
        """Sends the blocks of an open transfer as they become ready: one ``data`` frame per batch
        of newly ready blocks, the last with the checksum; an ``error`` frame when the prefill
        fails or the blocks are not ready within ``wait_ms``."""
        positions = progress.positions(request.block_ids)
        if positions is None or any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
            writer.write(encode_frame(ErrorReply(
                "invalid_read", f"the blocks read are not rows of transfer {request.transfer_id}, in its order",
            )))
            await writer.drain()
            return
        ids = request.block_ids
        n = len(ids)
        deadline = asyncio.get_running_loop().time() + min(request.wait_ms, MAX_WAIT_MS) / 1000.0
        sent = 0
        while True:
            ready = bisect.bisect_left(positions, progress.ready)  # requested blocks computed so far
            if ready > sent or (ready == n and sent == n == 0):
                last = ready == n
                writer.write(encode_frame(DataReply(
                    ready - sent, self._memory.block_bytes,
                    checksum=progress.checksum if last else None, ready_at=progress.ready_at if last else 0.0,
                )))
                await self._send_rows(ids[sent:ready], writer)
                sent = ready
            if sent == n:
                return
            try:
                loop = asyncio.get_running_loop()
                beat = loop.time() + HEARTBEAT_S
                try:
                    await progress.changed(min(beat, deadline))
                except TransferNotReady as exc:
                    if exc.failed or beat >= deadline:
                        raise
                    writer.write(encode_frame(DataReply(0, self._memory.block_bytes)))  # still computing
                    await writer.drain()
            except TransferNotReady as exc:
                code = "transfer_failed" if exc.failed else "not_ready"
                logger.info(
                    "kv_transfer.tcp.stream_ended agent=%s transfer_id=%s sent=%d of=%d code=%s reason=%r",
                    self._agent_name, request.transfer_id, sent, n, code, str(exc),
                )
                writer.write(encode_frame(ErrorReply(code, f"transfer {request.transfer_id}: {exc}")))
                await writer.drain()
                return

    async def _serve_watch(self, request: WatchRequest, writer: asyncio.StreamWriter) -> None:
        """Answers once more than ``have`` of the blocks are ready, or at the heartbeat with the
        same count, or with an ``error`` (failed, unknown, or not ready by ``wait_ms``)."""
        refusal = self._refusal(request)
        progress = self._memory.readiness.get(request.transfer_id)
        positions = progress.positions(request.block_ids) if progress is not None else None
        if refusal is None and progress is None:
            refusal = self._unknown(request.transfer_id)
        elif refusal is None and (positions is None or any(b <= a for a, b in zip(positions, positions[1:], strict=False))):
            refusal = f"the blocks watched are not rows of transfer {request.transfer_id}, in its order"
        if refusal is not None or progress is None or positions is None:
            code = "unknown_transfer" if progress is None else "invalid_read"
            writer.write(encode_frame(ErrorReply(code, refusal or "")))
            await writer.drain()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.wait_ms, MAX_WAIT_MS) / 1000.0
        n = len(positions)
        ready = bisect.bisect_left(positions, progress.ready)
        if ready <= request.have and ready < n:
            try:
                await progress.changed(min(loop.time() + HEARTBEAT_S, deadline))
            except TransferNotReady as exc:
                if exc.failed or loop.time() >= deadline:
                    code = "transfer_failed" if exc.failed else "not_ready"
                    writer.write(encode_frame(ErrorReply(code, f"transfer {request.transfer_id}: {exc}")))
                    await writer.drain()
                    return
            ready = bisect.bisect_left(positions, progress.ready)
        last = ready == n
        if ready > request.have and self._on_blocks_ready is not None:
            self._on_blocks_ready()
        writer.write(encode_frame(ReadyReply(
            ready, checksum=progress.checksum if last else None, ready_at=progress.ready_at if last else 0.0,
        )))
        await writer.drain()

    async def _send_rows(self, block_ids: list[int], writer: asyncio.StreamWriter) -> None:
        array = self._memory.array
        for start, stop in contiguous_runs(block_ids):
            rows = memoryview(array[start:stop].reshape(-1))
            for offset in range(0, len(rows), _CHUNK_BYTES):
                writer.write(rows[offset : offset + _CHUNK_BYTES])
                await writer.drain()
        await writer.drain()
        self.bytes_served += len(block_ids) * self._memory.block_bytes

    def _deliver(self, request: NotifyRequest) -> None:
        message = request.message[:MAX_NOTIFY_BYTES]
        deliver_notify(self._callback, message, backend="tcp", agent_name=self._agent_name)


def _peer_label(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
