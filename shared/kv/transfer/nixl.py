"""``NixlKvAgent``: the ``KvTransferAgent`` over NIXL (UCX backend) on host (DRAM) memory.

The worker's ``KvBlockMemory`` array is registered with a NIXL agent; its serialized agent
metadata (``get_agent_metadata()``) and the array's address go into ``KvTransferMetadata`` so a
decode worker can add the prefill worker as a remote agent and READ blocks by descriptor index
(one descriptor per block, prepared once per side, as vLLM's NixlConnector does). The read carries
the transfer id as its NIXL notification; a background task polls ``get_new_notifs()`` and hands
each message to the notify callback.

Every NIXL call is a blocking C call, so they all run in a small thread pool (the agent is created
with ``NIXL_THREAD_SYNC_STRICT``, which makes that safe); a transfer is posted and polled to
completion inside one pool thread with short sleeps, bounded by the read's deadline, and its handle
is released on every path (releasing an unfinished transfer aborts it). After a timeout or error
the remote agent is removed, so the next read re-adds it and reconnects.

The agent also runs a ``TcpKvAgent`` on the same memory (its address is in the metadata): a peer
without NIXL can still read from this worker, and this worker reads from such a peer over TCP.

Streamed reads (KV transfer overlapped with the prefill): a READ is one-sided and cannot wait for
blocks the peer is still computing, so the reader long-polls the peer's block server for how many
are ready (``watch``: no bytes, answered when more are, or at a heartbeat) and READs each newly
ready batch over NIXL; the last READ carries the completion notification, the last answer the
checksum. The readiness side channel is our TCP one rather than NIXL notifications: a prefill
agent could only ``send_notif`` to a decode agent whose metadata it had added, which it does not
have (decode agents are not looked up by prefill workers), and notifications are polled, where the
long-poll answers at once.

UCX on a CPU-only host: the defaults work (shared memory and TCP transports); ``UCX_TLS`` can
restrict them (e.g. ``UCX_TLS=tcp,self`` between hosts without RDMA).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from dynamod.shared.kv.transfer.base import (
    KvTransferError,
    KvTransferTimeout,
    NotifyCallback,
    TransferResult,
    deliver_notify,
    read_result,
)
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.tcp import TcpKvAgent, check_read_args, new_agent_name
from dynamod.shared.kv.transfer.tcp_wire import MAX_NOTIFY_BYTES
from dynamod.shared.protocol.kv_transfer import BACKEND_NIXL, KvLayout, KvTransferMetadata
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.tasks import stop_task
from dynamod.shared.transport.liveness import RequestPlaneMetrics

logger = logging.getLogger(__name__)

NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
"""``nixl`` is the meta package on GPU nodes; the CUDA-variant wheels also work alone (CPU hosts
install ``nixl-cu12`` without torch)."""

_POLL_MIN_S = 0.00005
_POLL_MAX_S = 0.001
"""A transfer's state is polled with sleeps growing from 50 us to 1 ms: small reads finish in
well under a millisecond, and a long one costs at most ~1000 wake-ups a second of one thread."""

_NOTIF_POLL_ACTIVE_S = 0.002
_NOTIF_POLL_IDLE_S = 0.02
"""Notification polling: fast right after a notification, slower when idle. A notification only
frees held blocks sooner, so 20 ms of extra hold is the worst case."""
_NOTIF_POLL_READ_S = 0.0005
_READ_EXPECTED_S = 0.01
"""While a peer is about to READ this agent's blocks (its watch was just answered with ready
blocks, or the engine handed out transfer parameters), progress is driven every
``_NOTIF_POLL_READ_S`` for ``_READ_EXPECTED_S`` (the READ follows within a few ms). With no UCX
progress thread, a READ between processes on this host completes only when the serving side
progresses too: measured live, a 2-block streamed read was exposed 7.5-13 ms at the 20 ms idle
poll, 1.2-4.0 ms with this."""

_THREAD_GRACE_S = 1.0
"""How long past its deadline a pool thread may take to give up before the read is abandoned."""


def load_nixl_api() -> ModuleType:
    """The NIXL Python API module; ImportError (naming what was tried) when none imports."""
    errors: list[str] = []
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        _adopt_nixl_logging()
        return api
    raise ImportError("NIXL is not installed (pip install 'dynamod[nixl]'); tried " + "; ".join(errors))


def _adopt_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines to stdout on its own handler; route it through
    ours instead (stderr, ``DYN_LOG``), and keep its per-agent chatter at WARNING unless
    ``NIXL_LOG_LEVEL`` asks for more. Stdout belongs to the program (JSON of a benchmark)."""
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
            nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


@dataclasses.dataclass(slots=True)
class _Peer:
    """A remote NIXL agent as added to ours, with its block descriptors prepared."""

    metadata: bytes
    base_address: int
    num_blocks: int
    nixl_name: str
    dlist: Any  # nixl_prepped_dlist_handle


def _block_descs(base_address: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """Nx3 (address, length, device id) rows: descriptor i is block i."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = 0
    return descs


class NixlKvAgent:
    """Reads remote blocks with NIXL READ when the peer advertises NIXL, over TCP otherwise."""

    backend = BACKEND_NIXL

    def __init__(
        self,
        memory: KvBlockMemory,
        *,
        worker_id: int,
        host: str = "127.0.0.1",
        port: int = 0,
        layout: KvLayout | None = None,
        advertise_host: str | None = None,
        security: RequestPlaneSecurity | None = None,
        metrics: RequestPlaneMetrics | None = None,
    ) -> None:
        self.memory = memory
        self.worker_id = worker_id
        self.agent_name = new_agent_name(worker_id)
        # The TCP side is guarded like the request plane; NIXL/UCX itself has no such guard.
        self._tcp = TcpKvAgent(
            memory, worker_id=worker_id, host=host, port=port, layout=layout, agent_name=self.agent_name,
            advertise_host=advertise_host, security=security, metrics=metrics,
        )
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"nixl-{self.agent_name}")
        self._api: ModuleType | None = None
        self._agent: Any = None
        self._reg: Any = None
        self._local_dlist: Any = None
        self._nixl_metadata = b""
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = asyncio.Lock()
        self._callback: NotifyCallback | None = None
        self._notif_task: asyncio.Task[None] | None = None
        self._read_expected_until = 0.0  # monotonic: poll at _NOTIF_POLL_READ_S until then
        self._poll_wake = asyncio.Event()
        self._tcp.set_blocks_ready_callback(self.expect_reads)
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Creates the NIXL agent (UCX), registers the memory, starts the TCP server and the
        notification poller. KvTransferError when NIXL or UCX cannot be set up here."""
        try:
            await self._run(self._create_sync)
        except KvTransferError:
            raise
        except Exception as exc:
            raise KvTransferError(f"NIXL agent {self.agent_name} could not start: {exc}") from exc
        await self._tcp.start()
        self._notif_task = asyncio.create_task(
            self._poll_notifications(), name=f"nixl-notifs:{self.agent_name}"
        )
        logger.info(
            "kv_transfer.nixl.started agent=%s tcp=%s blocks=%d block_bytes=%d metadata_bytes=%d",
            self.agent_name,
            self._tcp.address,
            self.memory.num_blocks,
            self.memory.block_bytes,
            len(self._nixl_metadata),
        )

    def _create_sync(self) -> None:
        api = load_nixl_api()
        # No UCX progress thread: it spins (0.9 of a core per idle agent, measured), and this agent
        # drives progress itself, polling each read to completion and notifications on a timer.
        config = api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        agent = api.nixl_agent(self.agent_name, config)
        if "UCX" not in agent.backends:
            raise KvTransferError(
                f"NIXL agent {self.agent_name} has no UCX backend (plugins: {agent.get_plugin_list()}); "
                "check the NIXL installation or use --kv-transfer-backend tcp"
            )
        memory = self.memory
        self._reg = agent.register_memory([(memory.base_address, memory.nbytes, 0, "")], "DRAM")
        self._local_dlist = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _block_descs(memory.base_address, memory.num_blocks, memory.block_bytes),
            "DRAM",
        )
        self._nixl_metadata = bytes(agent.get_agent_metadata())
        self._api = api
        self._agent = agent

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await stop_task(self._notif_task)
        await self._tcp.close()
        if self._agent is not None:
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(self._pool, self._teardown_sync)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _teardown_sync(self) -> None:
        agent = self._agent
        for peer in list(self._peers.values()):
            self._drop_peer_sync(peer)
        self._peers.clear()
        with contextlib.suppress(Exception):
            self._local_dlist.release()
        with contextlib.suppress(Exception):
            agent.deregister_memory(self._reg)
        self._agent = None

    # -- KvTransferAgent ------------------------------------------------------------------------

    def metadata(self) -> KvTransferMetadata:
        return msgspec.structs.replace(
            self._tcp.metadata(),
            backend=BACKEND_NIXL,
            nixl_metadata=self._nixl_metadata,
            base_address=self.memory.base_address,
        )

    def set_notify_callback(self, callback: NotifyCallback) -> None:
        self._callback = callback
        self._tcp.set_notify_callback(callback)

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
        if not _speaks_nixl(remote):
            return await self._tcp.read_blocks(
                remote, remote_block_ids, local_block_ids, timeout_s=timeout_s, notify=notify,
                transfer_id=transfer_id, streamed=streamed, idle_timeout_s=idle_timeout_s,
            )
        if streamed:
            if not transfer_id:
                raise KvTransferError("a streamed read needs the transfer id whose blocks it waits for")
            return await self._read_streamed(
                remote, list(remote_block_ids), list(local_block_ids), timeout_s, notify, transfer_id, idle_timeout_s
            )
        check_read_args(self.memory, remote, remote_block_ids, local_block_ids)
        if notify is not None and len(notify.encode()) > MAX_NOTIFY_BYTES:
            raise KvTransferError(
                f"notification of {len(notify)} characters is over {MAX_NOTIFY_BYTES} bytes"
            )
        started = time.monotonic()
        deadline = started + timeout_s
        peer = await self._peer(remote, timeout_s)
        message = notify.encode() if notify is not None else b""
        remaining = max(deadline - time.monotonic(), 0.0)
        try:
            state = await self._run(
                self._read_sync,
                peer,
                list(remote_block_ids),
                list(local_block_ids),
                message,
                deadline,
                timeout_s=remaining + _THREAD_GRACE_S,
            )
        except TimeoutError:
            state = "TIMEOUT"
        except Exception as exc:  # nixl raises its own types (e.g. nixlRemoteDisconnectError)
            state = f"ERR: {type(exc).__name__}: {exc}"
        if state != "DONE":
            await self._forget(remote.agent_name)
            what = f"reading {len(local_block_ids)} blocks from NIXL agent {remote.agent_name} ({remote.address})"
            logger.info(
                "kv_transfer.nixl.read_failed agent=%s remote=%s blocks=%d state=%s timeout_s=%s",
                self.agent_name,
                remote.agent_name,
                len(local_block_ids),
                state,
                timeout_s,
            )
            if state == "TIMEOUT":
                raise KvTransferTimeout(
                    f"{what} did not finish within {timeout_s}s; the peer is stalled or overloaded"
                )
            raise KvTransferError(f"{what} failed ({state}); the peer went away or refused it")
        return read_result(BACKEND_NIXL, self.agent_name, remote, len(local_block_ids), self.memory.block_bytes, started)

    async def _read_streamed(
        self,
        remote: KvTransferMetadata,
        remote_ids: list[int],
        local_ids: list[int],
        timeout_s: float,
        notify: str | None,
        transfer_id: str,
        idle_timeout_s: float | None,
    ) -> TransferResult:
        """A READ cannot wait for blocks the peer is still computing: long-poll the peer's block
        server for how many are ready (``TcpKvAgent.watch``: no bytes, a heartbeat while none is
        new) and READ each newly ready batch over NIXL; the last READ carries the notification,
        the last answer the checksum. A stalled peer misses its heartbeats (``idle_timeout_s``)."""
        check_read_args(self.memory, remote, remote_ids, local_ids)
        if notify is not None and len(notify.encode()) > MAX_NOTIFY_BYTES:
            raise KvTransferError(f"notification of {len(notify)} characters is over {MAX_NOTIFY_BYTES} bytes")
        started = time.monotonic()
        deadline = started + timeout_s
        peer = await self._peer(remote, timeout_s)
        n = len(remote_ids)
        done = 0
        poll_s = idle_timeout_s if idle_timeout_s is not None else timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvTransferTimeout(
                    f"streaming {n} blocks of transfer {transfer_id} from NIXL agent {remote.agent_name} did not "
                    f"finish within {timeout_s}s ({done} arrived)"
                )
            ready = await self._tcp.watch(
                remote, remote_ids, transfer_id, done, timeout_s=min(poll_s, left), wait_ms=int(left * 1000)
            )
            if ready.ready > done:
                last = ready.ready == n
                message = notify.encode() if last and notify is not None else b""
                state = await self._read_batch(peer, remote, remote_ids[done:ready.ready], local_ids[done:ready.ready],
                                               message, deadline)
                if state != "DONE":
                    await self._forget(remote.agent_name)
                    what = f"reading blocks {done}..{ready.ready} of transfer {transfer_id} from NIXL agent {remote.agent_name}"
                    if state == "TIMEOUT":
                        raise KvTransferTimeout(f"{what} did not finish within {timeout_s}s")
                    raise KvTransferError(f"{what} failed ({state}); the peer went away or refused it")
                done = ready.ready
            if done == n:
                if n == 0 and notify is not None:
                    await self.notify(remote, notify, timeout_s=max(deadline - time.monotonic(), 0.1))
                result = read_result(BACKEND_NIXL, self.agent_name, remote, n, self.memory.block_bytes, started)
                result.checksum, result.ready_at = ready.checksum, ready.ready_at
                return result

    async def _read_batch(
        self, peer: _Peer, remote: KvTransferMetadata, remote_ids: list[int], local_ids: list[int],
        message: bytes, deadline: float,
    ) -> str:
        remaining = max(deadline - time.monotonic(), 0.0)
        try:
            return await self._run(
                self._read_sync, peer, remote_ids, local_ids, message, deadline, timeout_s=remaining + _THREAD_GRACE_S
            )
        except TimeoutError:
            return "TIMEOUT"
        except Exception as exc:  # nixl raises its own types (e.g. nixlRemoteDisconnectError)
            return f"ERR: {type(exc).__name__}: {exc}"

    async def connect(self, remote: KvTransferMetadata, *, timeout_s: float) -> None:
        """The peer's block server connection (streamed reads watch over it) and, when it speaks
        NIXL, the peer added (``_add_peer_sync`` begins its UCX connection). Measured on this
        host: a first streamed READ of a fresh peer took 61-95 ms against 0.3-0.6 ms after it; the
        peer's addition and the connection's progress (driven by the notification poller) take
        most of that off the first request."""
        deadline = time.monotonic() + timeout_s
        await self._tcp.connect(remote, timeout_s=timeout_s)
        if _speaks_nixl(remote):
            await self._peer(remote, max(deadline - time.monotonic(), 0.0))

    async def notify(self, remote: KvTransferMetadata, message: str, *, timeout_s: float) -> None:
        if not _speaks_nixl(remote):
            await self._tcp.notify(remote, message, timeout_s=timeout_s)
            return
        if len(message.encode()) > MAX_NOTIFY_BYTES:
            raise KvTransferError(
                f"notification of {len(message)} characters is over {MAX_NOTIFY_BYTES} bytes"
            )
        deadline = time.monotonic() + timeout_s
        peer = await self._peer(remote, timeout_s)
        try:
            await self._run(
                self._agent.send_notif,
                peer.nixl_name,
                message.encode(),
                timeout_s=max(deadline - time.monotonic(), 0.0),
            )
        except TimeoutError:
            await self._forget(remote.agent_name)
            raise KvTransferTimeout(
                f"notifying NIXL agent {remote.agent_name} did not finish within {timeout_s}s"
            ) from None
        except Exception as exc:
            await self._forget(remote.agent_name)
            raise KvTransferError(f"notifying NIXL agent {remote.agent_name} failed: {exc}") from exc

    # -- internals ------------------------------------------------------------------------------

    async def _run(self, fn: Any, *args: Any, timeout_s: float | None = None) -> Any:
        """Runs a blocking NIXL call in the pool; TimeoutError after ``timeout_s`` (the thread
        finishes on its own; every call made here is bounded)."""
        if self._closed:
            raise KvTransferError(f"NIXL agent {self.agent_name} is closed")
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        if timeout_s is None:
            return await future
        return await asyncio.wait_for(future, timeout_s)

    async def _peer(self, remote: KvTransferMetadata, timeout_s: float) -> _Peer:
        """The remote agent, added on first use and re-added when its metadata changed (a peer
        restarted under the same name, or re-registered its memory)."""
        async with self._peers_lock:
            peer = self._peers.get(remote.agent_name)
            if (
                peer is not None
                and peer.metadata == remote.nixl_metadata
                and peer.base_address == remote.base_address
                and peer.num_blocks == remote.num_blocks
            ):
                return peer
            try:
                if peer is not None:
                    del self._peers[remote.agent_name]
                    await self._run(self._drop_peer_sync, peer, timeout_s=timeout_s)
                peer = await self._run(self._add_peer_sync, remote, timeout_s=timeout_s)
            except TimeoutError:
                raise KvTransferTimeout(
                    f"adding NIXL agent {remote.agent_name} did not finish within {timeout_s}s"
                ) from None
            except Exception as exc:
                raise KvTransferError(
                    f"cannot add NIXL agent {remote.agent_name} (worker {remote.worker_id:x}): {exc}"
                ) from exc
            self._peers[remote.agent_name] = peer
            return peer

    async def _forget(self, agent_name: str) -> None:
        async with self._peers_lock:
            peer = self._peers.pop(agent_name, None)
        if peer is not None:
            with contextlib.suppress(Exception):
                await self._run(self._drop_peer_sync, peer, timeout_s=_THREAD_GRACE_S)

    def _add_peer_sync(self, remote: KvTransferMetadata) -> _Peer:
        agent = self._agent
        name = agent.add_remote_agent(remote.nixl_metadata)
        nixl_name = name.decode() if isinstance(name, bytes) else str(name)
        descs = _block_descs(remote.base_address, remote.num_blocks, remote.block_bytes)
        try:
            dlist = agent.prep_xfer_dlist(nixl_name, descs, "DRAM")
        except Exception:
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(nixl_name)
            raise
        # Begin the UCX connection now (NIXL >= 1.0; asynchronous, progressed by our polling)
        # rather than in the first READ, which otherwise pays its wire-up.
        try:
            agent.make_connection(nixl_name)
        except Exception as exc:  # noqa: BLE001 - optional: the first READ connects anyway
            logger.info("kv_transfer.nixl.connect_deferred agent=%s remote=%s error=%s", self.agent_name, nixl_name, exc)
        logger.info(
            "kv_transfer.nixl.peer_added agent=%s remote=%s blocks=%d",
            self.agent_name,
            nixl_name,
            remote.num_blocks,
        )
        return _Peer(remote.nixl_metadata, remote.base_address, remote.num_blocks, nixl_name, dlist)

    def _drop_peer_sync(self, peer: _Peer) -> None:
        with contextlib.suppress(Exception):
            peer.dlist.release()
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer.nixl_name)

    def _read_sync(
        self, peer: _Peer, remote_ids: list[int], local_ids: list[int], message: bytes, deadline: float
    ) -> str:
        """Posts one READ and polls it to DONE, ERR or the deadline ("TIMEOUT"), in a pool thread."""
        agent = self._agent
        handle = agent.make_prepped_xfer(
            "READ",
            self._local_dlist,
            np.asarray(local_ids, dtype=np.int32),
            peer.dlist,
            np.asarray(remote_ids, dtype=np.int32),
            message,
        )
        try:
            state = agent.transfer(handle)
            pause = _POLL_MIN_S
            while state == "PROC":
                if time.monotonic() >= deadline:
                    return "TIMEOUT"
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
                state = agent.check_xfer_state(handle)
            return state
        finally:
            try:
                handle.release()  # aborts a transfer still in flight
            except Exception as exc:
                logger.info(
                    "kv_transfer.nixl.release_failed agent=%s remote=%s error=%s",
                    self.agent_name,
                    peer.nixl_name,
                    exc,
                )

    async def _poll_notifications(self) -> None:
        pause = _NOTIF_POLL_IDLE_S
        while True:
            try:
                notifs: dict[Any, list[bytes]] = await self._run(self._agent.get_new_notifs)
            except Exception as exc:
                logger.warning("kv_transfer.nixl.notif_poll_failed agent=%s error=%s", self.agent_name, exc)
                notifs = {}
            got = False
            for messages in notifs.values():
                for raw in messages:
                    got = True
                    self._deliver(raw.decode(errors="replace"))
            pause = _NOTIF_POLL_ACTIVE_S if got else min(pause * 2, _NOTIF_POLL_IDLE_S)
            if time.monotonic() < self._read_expected_until:
                await asyncio.sleep(_NOTIF_POLL_READ_S)
                continue
            self._poll_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_wake.wait(), pause)

    def expect_reads(self) -> None:
        """A peer will READ soon (a watcher was told of ready blocks, or transfer parameters were
        handed out): progress promptly for a while."""
        self._read_expected_until = time.monotonic() + _READ_EXPECTED_S
        self._poll_wake.set()

    def _deliver(self, message: str) -> None:
        deliver_notify(self._callback, message, backend=BACKEND_NIXL, agent_name=self.agent_name)


def _speaks_nixl(remote: KvTransferMetadata) -> bool:
    return remote.backend == BACKEND_NIXL and bool(remote.nixl_metadata) and remote.base_address != 0
