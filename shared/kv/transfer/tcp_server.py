"""The serving half of our TCP KV block transport: answers reads of one ``KvBlockMemory``.

Every request is validated before a byte of block data is sent (block size, ids, frame size), and a
refused request gets an ``error`` frame that the reader turns into a ``KvTransferError`` with the
same message; the connection stays usable. Block rows go to the socket as views of the array (one
write per run of consecutive ids, in bounded chunks), so the asyncio transport copies only what
the kernel did not take at once, and ``drain`` keeps that bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from dynamod.shared.kv.transfer.base import NotifyCallback, deliver_notify
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.tcp_wire import (
    LENGTH,
    LENGTH_SIZE,
    MAX_BLOCKS_PER_READ,
    MAX_FRAME_BYTES,
    MAX_NOTIFY_BYTES,
    DataReply,
    ErrorReply,
    NotifyRequest,
    OkReply,
    ReadRequest,
    contiguous_runs,
    encode_frame,
    request_decoder,
)

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 4 << 20
"""Bytes handed to the transport per write; with a high-water mark of the same size the transport
buffers at most about two chunks per connection."""


class KvBlockServer:
    """asyncio TCP server of one agent's block memory. ``notify`` messages go to the callback."""

    def __init__(self, memory: KvBlockMemory, agent_name: str, host: str, port: int) -> None:
        self._memory = memory
        self._agent_name = agent_name
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._callback: NotifyCallback | None = None
        self.bytes_served = 0

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("KV block server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    def set_notify_callback(self, callback: NotifyCallback) -> None:
        self._callback = callback

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port, limit=MAX_FRAME_BYTES)
        logger.info(
            "kv_transfer.tcp.serving agent=%s host=%s port=%d blocks=%d block_bytes=%d",
            self._agent_name,
            self._host,
            self.port,
            self._memory.num_blocks,
            self._memory.block_bytes,
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
        try:
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
                else:
                    self._deliver(request)
                    writer.write(encode_frame(OkReply()))
                    await writer.drain()
        except asyncio.CancelledError:
            return  # close() stops the handlers; the stream callback must not see a cancelled task
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            logger.info("kv_transfer.tcp.reader_lost agent=%s peer=%s reason=%s", self._agent_name, peer, exc)
        finally:
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    def _refusal(self, request: ReadRequest) -> str | None:
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
        array = self._memory.array
        writer.write(encode_frame(DataReply(len(request.block_ids), self._memory.block_bytes)))
        for start, stop in contiguous_runs(request.block_ids):
            rows = memoryview(array[start:stop].reshape(-1))
            for offset in range(0, len(rows), _CHUNK_BYTES):
                writer.write(rows[offset : offset + _CHUNK_BYTES])
                await writer.drain()
        await writer.drain()
        self.bytes_served += len(request.block_ids) * self._memory.block_bytes

    def _deliver(self, request: NotifyRequest) -> None:
        message = request.message[:MAX_NOTIFY_BYTES]
        deliver_notify(self._callback, message, backend="tcp", agent_name=self._agent_name)
