"""``TcpKvAgent``: the ``KvTransferAgent`` over our own TCP block transport.

It needs nothing beyond the standard library, so every worker can serve and read KV blocks even
where NIXL is not installed (``dynamod up`` on a laptop), and a NIXL agent runs one too so that
TCP-only peers can still read from it. Frames are in ``tcp_wire``; the server in ``tcp_server``;
the reader's zero-copy receive and connection pool in ``tcp_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from dynamod.shared.kv.transfer.base import (
    KvTransferError,
    KvTransferTimeout,
    NotifyCallback,
    TransferResult,
    read_result,
)
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.tcp_client import KvConnectionPool, KvReadConnection
from dynamod.shared.kv.transfer.tcp_server import KvBlockServer
from dynamod.shared.kv.transfer.tcp_wire import (
    MAX_NOTIFY_BYTES,
    DataReply,
    ErrorReply,
    NotifyRequest,
    OkReply,
    ReadRequest,
    ReadyReply,
    Reply,
    WatchRequest,
    contiguous_runs,
    encode_frame,
    join_address,
)
from dynamod.shared.protocol.kv_transfer import BACKEND_TCP, KvLayout, KvTransferMetadata
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.transport.address import advertised_host
from dynamod.shared.transport.guard import ClientCredentials
from dynamod.shared.transport.liveness import RequestPlaneMetrics

logger = logging.getLogger(__name__)


def new_agent_name(worker_id: int) -> str:
    """Unique per agent instance: a restarted worker with the same id is a different agent."""
    return f"{worker_id:x}-{uuid.uuid4().hex[:12]}"


def check_read_args(
    memory: KvBlockMemory,
    remote: KvTransferMetadata,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
) -> None:
    """Refuses a read that cannot be right before any connection is made (both backends)."""
    if len(remote_block_ids) != len(local_block_ids):
        raise KvTransferError(
            f"read of {len(remote_block_ids)} remote blocks into {len(local_block_ids)} local blocks; "
            "the lists must have the same length"
        )
    if remote.block_bytes != memory.block_bytes:
        raise KvTransferError(
            f"block size mismatch: agent {remote.agent_name} (worker {remote.worker_id:x}) has "
            f"{remote.block_bytes}-byte blocks, this worker {memory.block_bytes}; prefill and decode "
            "workers must serve the same model with the same block size and KV dtype"
        )
    try:
        memory.check_ids(local_block_ids)
    except ValueError as exc:
        raise KvTransferError(f"local {exc}") from exc
    bad = [b for b in remote_block_ids if not 0 <= b < remote.num_blocks]
    if bad:
        raise KvTransferError(
            f"remote block ids {bad[:8]} are outside agent {remote.agent_name}'s [0, {remote.num_blocks})"
        )


class TcpKvAgent:
    """Serves reads of ``memory`` on (host, port) and reads remote blocks over pooled connections.
    The metadata advertises ``advertise_host`` (default: ``host``, or this node's primary address
    for a wildcard); ``security`` guards both halves (TLS, cluster token)."""

    backend = BACKEND_TCP

    def __init__(
        self,
        memory: KvBlockMemory,
        *,
        worker_id: int,
        host: str = "127.0.0.1",
        port: int = 0,
        layout: KvLayout | None = None,
        agent_name: str | None = None,
        advertise_host: str | None = None,
        security: RequestPlaneSecurity | None = None,
        metrics: RequestPlaneMetrics | None = None,
    ) -> None:
        self.memory = memory
        self.worker_id = worker_id
        self.agent_name = agent_name or new_agent_name(worker_id)
        self._host = host
        self._advertise_host = advertise_host
        self._layout = layout
        # One set of credentials for both halves: what this agent demands of readers is what it
        # presents to the agents it reads from (every worker of a cluster shares them).
        self._server = KvBlockServer(memory, self.agent_name, host, port, security=security, metrics=metrics)
        self._pool = KvConnectionPool(ClientCredentials(security))
        self._address: str | None = None

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("TcpKvAgent.start() was not called")
        return self._address

    async def start(self) -> None:
        await self._server.start()
        self._address = join_address(advertised_host(self._host, self._advertise_host), self._server.port)

    def metadata(self) -> KvTransferMetadata:
        return KvTransferMetadata(
            worker_id=self.worker_id,
            backend=BACKEND_TCP,
            agent_name=self.agent_name,
            address=self.address,
            num_blocks=self.memory.num_blocks,
            block_bytes=self.memory.block_bytes,
            layout=self._layout,
        )

    def set_notify_callback(self, callback: NotifyCallback) -> None:
        self._server.set_notify_callback(callback)

    def expect_reads(self) -> None:
        """Nothing to do: the block server answers each read as it comes."""

    def set_blocks_ready_callback(self, callback: Callable[[], None]) -> None:
        """Called when this agent's block server tells a watcher that more blocks are ready."""
        self._server.set_blocks_ready_callback(callback)

    async def read_blocks(
        self,
        remote: KvTransferMetadata,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        timeout_s: float,
        notify: str | None = None,
        transfer_id: str | None = None,
        streamed: bool = False,
        idle_timeout_s: float | None = None,
    ) -> TransferResult:
        check_read_args(self.memory, remote, remote_block_ids, local_block_ids)
        if notify is not None:
            _check_notify(notify)
        if streamed and not transfer_id:
            raise KvTransferError("a streamed read needs the transfer id whose blocks it waits for")
        array = self.memory.array
        targets = [memoryview(array[a:b].reshape(-1)) for a, b in contiguous_runs(list(local_block_ids))]
        # A streamed read lets the server wait for blocks still being computed, up to our deadline.
        wait_ms = max(int(timeout_s * 1000), 1) if streamed else 0
        read = encode_frame(ReadRequest(list(remote_block_ids), self.memory.block_bytes, transfer_id or "", wait_ms))
        started = time.monotonic()
        last: list[DataReply] = []

        async def exchange(conn: KvReadConnection) -> None:
            if streamed and idle_timeout_s is not None:
                reply = await _watched(conn, conn.request(read, targets), idle_timeout_s, remote)
            else:
                reply = await conn.request(read, targets)
            _expect(reply, remote, "read")
            if isinstance(reply, DataReply):
                last.append(reply)
            if notify is not None:
                _expect(await conn.request(encode_frame(NotifyRequest(notify))), remote, "notify")

        await self._with_connection(remote, exchange, timeout_s, f"reading {len(local_block_ids)} blocks")
        result = read_result(BACKEND_TCP, self.agent_name, remote, len(local_block_ids), self.memory.block_bytes, started)
        if last:
            result.checksum, result.ready_at = last[-1].checksum, last[-1].ready_at
        return result

    async def watch(
        self, remote: KvTransferMetadata, block_ids: Sequence[int], transfer_id: str, have: int, *,
        timeout_s: float, wait_ms: int,
    ) -> ReadyReply:
        """How many of ``block_ids`` (a prefix) of the remote's open transfer are computed, once
        more than ``have`` are or at the server's heartbeat (``tcp_wire``'s ``watch``): what a
        one-sided reader (NIXL) long-polls before each READ. ``timeout_s`` bounds this poll, so a
        peer that misses its heartbeats is a ``KvTransferTimeout``."""
        frame = encode_frame(WatchRequest(list(block_ids), self.memory.block_bytes, transfer_id, have, max(wait_ms, 1)))
        replies: list[ReadyReply] = []

        async def exchange(conn: KvReadConnection) -> None:
            reply = await conn.request(frame)
            _expect(reply, remote, "watch")
            if not isinstance(reply, ReadyReply):
                raise KvTransferError(f"KV agent {remote.agent_name} at {remote.address} answered a watch with {reply!r}")
            replies.append(reply)

        await self._with_connection(remote, exchange, timeout_s, f"watching transfer {transfer_id}")
        return replies[-1]

    async def connect(self, remote: KvTransferMetadata, *, timeout_s: float) -> None:
        """Dials ``remote``'s block server (TLS and token included) and pools the connection."""
        try:
            async with asyncio.timeout(timeout_s):
                conn, _ = await self._pool.acquire(remote.address)
        except TimeoutError:
            raise KvTransferTimeout(
                f"connecting to KV agent {remote.agent_name} at {remote.address} did not finish within {timeout_s}s"
            ) from None
        self._pool.release(conn)

    async def notify(self, remote: KvTransferMetadata, message: str, *, timeout_s: float) -> None:
        _check_notify(message)
        frame = encode_frame(NotifyRequest(message))

        async def exchange(conn: KvReadConnection) -> None:
            _expect(await conn.request(frame), remote, "notify")

        await self._with_connection(remote, exchange, timeout_s, "notifying")

    async def close(self) -> None:
        self._pool.close()
        await self._server.close()

    async def _with_connection(
        self,
        remote: KvTransferMetadata,
        exchange: Callable[[KvReadConnection], Awaitable[None]],
        timeout_s: float,
        what: str,
    ) -> None:
        """Runs ``exchange`` on a pooled connection under one deadline. A reused connection that
        fails before any block byte arrived (the peer restarted while it sat idle) is retried
        once on a fresh one: reads and notifications are safe to repeat."""
        conn: KvReadConnection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                conn, reused = await self._pool.acquire(remote.address)
                try:
                    await exchange(conn)
                except KvTransferError as exc:
                    if isinstance(exc, KvTransferTimeout) or not (reused and conn.closed and conn.received_bytes == 0):
                        raise
                    conn = await self._pool.dial(remote.address)
                    await exchange(conn)
        except TimeoutError:
            if conn is not None:
                conn.abort()
            received = conn.received_bytes if conn is not None else 0
            logger.info(
                "kv_transfer.tcp.timeout agent=%s remote=%s address=%s timeout_s=%s received_bytes=%d",
                self.agent_name,
                remote.agent_name,
                remote.address,
                timeout_s,
                received,
            )
            raise KvTransferTimeout(
                f"{what} from KV agent {remote.agent_name} at {remote.address} did not finish within "
                f"{timeout_s}s ({received} block bytes arrived); the peer is stalled or overloaded"
            ) from None
        except BaseException:
            if conn is not None:
                conn.abort()
            raise
        self._pool.release(conn)


async def _watched(conn: KvReadConnection, request: Awaitable[Reply], idle_s: float, remote: KvTransferMetadata) -> Reply:
    """A streamed read's reply, given up (``KvTransferTimeout``) once the server has sent nothing,
    not even a heartbeat, for ``idle_s``: a prefill still computing keeps its heartbeats coming."""
    task = asyncio.ensure_future(request)
    conn.last_heard = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=min(idle_s / 4, 0.25))
            if done:
                return task.result()
            silent = time.monotonic() - conn.last_heard
            if silent > idle_s:
                conn.abort()
                raise KvTransferTimeout(
                    f"KV agent {remote.agent_name} at {remote.address} sent nothing for {silent:.1f}s while streaming "
                    f"({conn.received_bytes} of {conn.expected_bytes} block bytes arrived); the peer is stalled"
                )
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _check_notify(message: str) -> None:
    if len(message.encode()) > MAX_NOTIFY_BYTES:
        raise KvTransferError(f"notification of {len(message)} characters is over {MAX_NOTIFY_BYTES} bytes")


def _expect(reply: Reply, remote: KvTransferMetadata, what: str) -> None:
    if isinstance(reply, ErrorReply):
        raise KvTransferError(
            f"KV agent {remote.agent_name} at {remote.address} refused the {what}: {reply.message}"
        )
    if what == "notify" and not isinstance(reply, OkReply):
        raise KvTransferError(
            f"KV agent {remote.agent_name} at {remote.address} answered a notify with {reply!r}"
        )
