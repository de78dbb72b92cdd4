"""The transfer seam: one ``KvTransferAgent`` Protocol, several small implementations.

An agent owns one worker's registered KV block memory (``KvBlockMemory``). The decode side calls
``read_blocks`` to copy blocks of a remote worker into its own blocks; the read carries a
notification (the transfer id) that reaches the remote agent's ``on_notify`` callback once the
bytes have arrived, which is when the prefill side frees the blocks it held. Every agent also
serves reads of its own memory, so any worker can be read from.

Errors: ``KvTransferError`` (a ``TransportError``: the peer is gone or answered badly) and
``KvTransferTimeout`` (the deadline passed). Both leave the local blocks in an undefined state;
the caller recomputes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dynamod.shared.errors import DeadlineExceededError, TransportError
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata

logger = logging.getLogger(__name__)


class KvTransferError(TransportError):
    """A KV block read failed: the remote agent is unreachable, refused it, or broke off."""

    code = "kv_transfer_error"


class KvTransferTimeout(KvTransferError, DeadlineExceededError):
    """A KV block read did not finish before its deadline (a stalled or frozen peer)."""

    code = "kv_transfer_timeout"


@dataclass(slots=True)
class TransferResult:
    """What one ``read_blocks`` moved and how long it took (wall clock). A read that named its
    transfer learns from the server the checksum of the transfer's blocks and when the last of
    them was computed (``ready_at``, ``time.time()``; 0 when the server did not say)."""

    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    checksum: int | None = None
    ready_at: float = 0.0


NotifyCallback = Callable[[str], None]


def deliver_notify(callback: NotifyCallback | None, message: str, *, backend: str, agent_name: str) -> None:
    """Hands a peer's notification to the owner's callback; a missing or failing callback is
    logged, never raised into the transport that received it."""
    if callback is None:
        logger.info("kv_transfer.%s.notify_dropped agent=%s message=%s reason=no_callback", backend, agent_name, message)
        return
    try:
        callback(message)
    except Exception:
        logger.exception("kv_transfer.%s.notify_callback_failed agent=%s message=%s", backend, agent_name, message)


def read_result(
    backend: str, agent_name: str, remote: KvTransferMetadata, num_blocks: int, block_bytes: int, started: float
) -> TransferResult:
    """The result of a read that began at ``started`` (monotonic), logged at debug."""
    seconds = time.monotonic() - started
    num_bytes = num_blocks * block_bytes
    logger.debug(
        "kv_transfer.%s.read agent=%s remote=%s blocks=%d bytes=%d seconds=%.6f",
        backend, agent_name, remote.agent_name, num_blocks, num_bytes, seconds,
    )
    return TransferResult(num_blocks=num_blocks, num_bytes=num_bytes, seconds=seconds, backend=backend)


@runtime_checkable
class KvTransferAgent(Protocol):
    """One worker's transfer endpoint. Created by ``shared.kv.transfer.factory.create_agent``."""

    backend: str  # BACKEND_NIXL | BACKEND_TCP

    async def start(self) -> None:
        """Registers the memory and starts serving reads; after it, ``metadata()`` is valid."""
        ...

    def metadata(self) -> KvTransferMetadata:
        """What peers need to read from this agent (advertised in discovery)."""
        ...

    def set_notify_callback(self, callback: NotifyCallback) -> None:
        """Called (on the event loop) with the notification of every completed remote read."""
        ...

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
        """Copies ``remote_block_ids`` of ``remote`` into ``local_block_ids`` of this agent's
        memory (same length, same ``block_bytes``), then delivers ``notify`` to the remote agent.
        ``streamed``: the blocks of ``transfer_id`` may still be being computed; the remote agent
        sends each as it becomes ready (``readiness.py``), and the read ends when the last lands;
        ``idle_timeout_s``: it fails (``KvTransferTimeout``) when the remote agent sends neither a
        block nor a heartbeat for that long (a stalled peer, not a prefill still computing).
        Raises ``KvTransferTimeout`` after ``timeout_s``, ``KvTransferError`` on any failure
        (a streamed read also when the remote prefill failed)."""
        ...

    async def connect(self, remote: KvTransferMetadata, *, timeout_s: float) -> None:
        """Readies reads from ``remote`` before one needs them (a decode worker calls it when a
        prefill worker appears, ``peer_warmer.py``): a pooled connection to its block server and,
        over NIXL, the peer added with its descriptors prepared and its UCX connection begun.
        Optional for correctness (a read does all of it on first use), not for the first
        request's latency. Raises ``KvTransferTimeout`` after ``timeout_s``, ``KvTransferError``
        when the peer cannot be reached."""
        ...

    def expect_reads(self) -> None:
        """A peer will read this agent's blocks soon (the engine just handed out transfer
        parameters): an agent whose reads need its own progress (NIXL without a progress thread)
        drives it promptly for a while."""
        ...

    async def notify(self, remote: KvTransferMetadata, message: str, *, timeout_s: float) -> None:
        """Delivers ``message`` to the remote agent without reading (the decode side found every
        block in its own cache, or gave up on the read): the prefill side frees its blocks."""
        ...

    async def close(self) -> None:
        """Stops serving, releases registrations and connections. Idempotent."""
        ...
