"""``BlockReadiness``: which rows of a transfer a prefill is still computing, so a block server can
stream them as they become ready (KV transfer overlapped with the prefill).

A prefill engine that hands out a prompt's transfer parameters before its prefill ends (``streaming``
parameters, sent when the prompt is admitted) opens the transfer here with the rows it allocated, in
prompt order, and advances a count of how many of them (a prefix: a prefill computes in order) hold
their final bytes after each chunk. ``complete`` marks the last row ready, with the checksum of all
of them and the wall-clock time it happened (the reader reports the exposed transfer from it). A
prefill that stops early (aborted, preempted, its reader gave up) ``fail``s the transfer: waiting
readers get the reason at once, and later reads of it are refused as unknown.

One instance per ``KvBlockMemory`` (``memory.readiness``), shared by the engine that computes into
the memory and the server that reads it, on one event loop. Entries live from ``open`` until
``close`` (the hold was released or expired) or ``fail``: as many as prompts in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


class TransferNotReady(Exception):
    """Rows of a transfer did not become ready in time, or never will (``failed``: the reason)."""

    def __init__(self, message: str, *, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


@dataclass(slots=True)
class TransferProgress:
    """One open transfer: ``rows[:ready]`` hold their final bytes."""

    rows: list[int]
    ready: int = 0
    checksum: int | None = None  # of every row, in order, once complete
    ready_at: float = 0.0  # time.time() when the last row became ready
    failure: str | None = None
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)
    _positions: dict[int, int] | None = None

    @property
    def complete(self) -> bool:
        return self.ready >= len(self.rows)

    def positions(self, block_ids: Sequence[int]) -> list[int] | None:
        """Each id's place in ``rows``; None if one is not a row of this transfer."""
        if self._positions is None:
            self._positions = {row: i for i, row in enumerate(self.rows)}
        index = self._positions
        out = []
        for b in block_ids:
            i = index.get(b)
            if i is None:
                return None
            out.append(i)
        return out

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def changed(self, deadline: float) -> None:
        """Waits until the transfer advances, completes or fails, or ``deadline`` (loop time)
        passes (``TransferNotReady``). Raises ``TransferNotReady(failed=True)`` on a failure."""
        if self.failure is not None:
            raise TransferNotReady(self.failure, failed=True)
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0:
            raise TransferNotReady(f"{len(self.rows) - self.ready} of {len(self.rows)} blocks still being computed")
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(left):
                await waiter
        except TimeoutError:
            raise TransferNotReady(
                f"{len(self.rows) - self.ready} of {len(self.rows)} blocks were still being computed at the deadline"
            ) from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        if self.failure is not None:
            raise TransferNotReady(self.failure, failed=True)


class BlockReadiness:
    """The open transfers of one block memory, by transfer id."""

    __slots__ = ("_transfers", "_ended")

    RECENT_ENDS = 256
    """Failed transfers whose reason is kept for a reader asking after the fact (a long-polling one)."""

    def __init__(self) -> None:
        self._transfers: dict[str, TransferProgress] = {}
        self._ended: dict[str, str] = {}  # transfer id -> why it failed, the most recent ones

    def ended(self, transfer_id: str) -> str | None:
        """Why a recently failed transfer failed; None if it did not (or long ago)."""
        return self._ended.get(transfer_id)

    def __len__(self) -> int:
        return len(self._transfers)

    def get(self, transfer_id: str) -> TransferProgress | None:
        return self._transfers.get(transfer_id)

    def open(self, transfer_id: str, rows: Sequence[int], ready: int = 0) -> TransferProgress:
        """Starts tracking a transfer whose first ``ready`` rows are already computed (a cached prefix)."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already open")
        progress = TransferProgress(list(rows), min(max(ready, 0), len(rows)))
        self._transfers[transfer_id] = progress
        return progress

    def advance(self, transfer_id: str, ready: int) -> None:
        """``rows[:ready]`` are computed now (never moves back; capped below the last row, which
        only ``complete`` marks, with the checksum)."""
        progress = self._transfers.get(transfer_id)
        if progress is None:
            return
        ready = min(ready, len(progress.rows) - 1)
        if ready > progress.ready:
            progress.ready = ready
            progress._wake()

    def complete(self, transfer_id: str, checksum: int | None, ready_at: float | None = None) -> None:
        """Every row is computed; ``checksum`` covers them all, in order."""
        progress = self._transfers.get(transfer_id)
        if progress is None:
            return
        progress.ready = len(progress.rows)
        progress.checksum = checksum
        progress.ready_at = time.time() if ready_at is None else ready_at
        progress._wake()

    def fail(self, transfer_id: str, reason: str) -> bool:
        """The rows will never be ready: waiting readers get ``reason`` and the transfer is
        forgotten. False if it was not open."""
        progress = self._transfers.pop(transfer_id, None)
        if progress is None:
            return False
        progress.failure = reason
        progress._wake()
        ended = self._ended
        ended[transfer_id] = reason
        if len(ended) > self.RECENT_ENDS:
            del ended[next(iter(ended))]
        return True

    def close(self, transfer_id: str) -> None:
        """The transfer's blocks were released: forget it (readers still waiting fail)."""
        self.fail(transfer_id, f"transfer {transfer_id} was released")
