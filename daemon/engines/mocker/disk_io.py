"""The disk tier's file I/O on one background thread, so an engine step never waits for a file.

Writing a block file inline stalled every running request of the rank for as long as the file
took; reading one stalled them again. Here the step loop only *submits* jobs and later *polls*
what finished; one thread per rank does the files, in this order:

- reads first (a request is waiting for them), in submission order;
- then writes and deletes, in submission order, so a delete always follows the write of the same
  block it undoes, and a rewrite of a hash follows the delete of its previous file.

Every job that carries a block's bytes (writes, reads) counts against ``max_pending`` from
submission until the owner has polled its completion: that bounds the memory the queue holds.
When full, ``try_write``/``try_read`` say no and the caller does without (the block is not
offloaded, or not onboarded); a cache may always forget. Deletes carry no bytes and are never
refused: each one undoes a file that exists or a write still queued, so there are never more of
them than the tier's capacity plus ``max_pending``.

Files are written under a temporary name and renamed (``DiskStore.write``), so whatever stops
the thread (``close``, a crash) leaves no half-written block behind a valid name.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynamod.daemon.engines.mocker.disk_tier import DiskStore
from dynamod.daemon.engines.mocker.tier_entry import TierEntry

logger = logging.getLogger(__name__)

WRITE = "write"
READ = "read"
_DELETE = "delete"


@dataclass(slots=True)
class DiskCompletion:
    """A finished write or read. ``error`` set: it failed (the file is unusable)."""

    kind: str  # WRITE | READ
    block_hash: int
    entry: TierEntry | None = None  # the entry written (WRITE)
    data: np.ndarray | None = None  # the block's bytes (READ, when it worked)
    error: str | None = None


@dataclass(slots=True)
class _Job:
    kind: str
    block_hash: int
    entry: TierEntry | None = None
    data: np.ndarray | None = None


class DiskIo:
    """One rank's disk-tier worker thread and its bounded job queue."""

    def __init__(
        self, store: DiskStore, *, max_pending: int, name: str = "dynamod-kv-disk",
        on_complete: Callable[[], None] | None = None,
    ) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.store = store
        self.max_pending = max_pending
        # Called on the I/O thread after each completion (the engine wakes its step loop with it).
        self.on_complete = on_complete
        self._cond = threading.Condition()
        self._reads: deque[_Job] = deque()
        self._writes: deque[_Job] = deque()  # writes and deletes, in order
        self._done: list[DiskCompletion] = []
        self._pending = 0  # byte-carrying jobs submitted and not yet polled
        self._busy = False  # the thread is doing a job now
        self._closing = False
        self._discard = False
        self.refused = 0  # submissions refused because the queue was full
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the owner's side (the core's thread) -----------------------------------------------------

    @property
    def closing(self) -> bool:
        """``close`` has begun: nothing more may be submitted."""
        return self._closing

    @property
    def pending(self) -> int:
        """Byte-carrying jobs submitted and not yet polled."""
        return self._pending

    def try_write(self, entry: TierEntry, data: np.ndarray) -> bool:
        """Queues the block file of ``entry``; False (nothing queued) when the queue is full."""
        return self._submit(_Job(WRITE, entry.block_hash, entry, data), self._writes)

    def try_read(self, block_hash: int) -> bool:
        """Queues a read of one block file; False (nothing queued) when the queue is full."""
        return self._submit(_Job(READ, block_hash), self._reads)

    def delete(self, block_hash: int) -> None:
        """Removes a block's file, after any write of it queued before. A write of it still queued
        is dropped instead of done (the block left the tier before its file was written)."""
        with self._cond:
            if self._closing:
                raise RuntimeError("the disk tier is closed")
            writes = self._writes
            for job in writes:
                if job.kind == WRITE and job.block_hash == block_hash:
                    writes.remove(job)
                    self._pending -= 1
                    break
            writes.append(_Job(_DELETE, block_hash))
            self._cond.notify_all()

    def poll(self) -> list[DiskCompletion]:
        """The completions since the last poll, oldest first (never blocks)."""
        with self._cond:
            done, self._done = self._done, []
            self._pending -= len(done)
            return done

    def wait(self, timeout: float) -> bool:
        """Blocks until a completion is ready to poll, or nothing is in flight; False on timeout.
        For synchronous drivers (tests, tools); the engine is woken by ``on_complete`` instead."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done or not self._in_flight(), timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Blocks until every queued job is done (completions may still wait to be polled)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight(), timeout)

    def close(self, *, flush: bool, timeout: float = 60.0) -> None:
        """Stops the thread. ``flush``: every queued write and delete is done first (a persistent
        tier keeps what its index says); else queued writes are dropped (deletes still run, and a
        write in progress ends with its rename or not at all)."""
        with self._cond:
            self._closing = True
            self._discard = not flush
            if not flush:
                kept = [job for job in self._writes if job.kind == _DELETE]
                self._pending -= len(self._writes) - len(kept)
                self._writes = deque(kept)
                self._pending -= len(self._reads)
                self._reads.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("disk kv io did not finish directory=%s timeout_s=%g", self.store.directory, timeout)

    # ---- internals --------------------------------------------------------------------------------

    def _submit(self, job: _Job, queue: deque[_Job]) -> bool:
        with self._cond:
            if self._closing:
                raise RuntimeError("the disk tier is closed")
            if self._pending >= self.max_pending:
                self.refused += 1
                return False
            self._pending += 1
            queue.append(job)
            self._cond.notify_all()
            return True

    def _in_flight(self) -> bool:
        return bool(self._reads or self._writes or self._busy)

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                cond.wait_for(lambda: self._reads or self._writes or self._closing)
                if self._reads:
                    job = self._reads.popleft()
                elif self._writes:
                    job = self._writes.popleft()
                else:
                    cond.notify_all()  # closing with nothing left: wake wait_idle callers
                    return
                self._busy = True
            done = self._do(job)
            with cond:
                self._busy = False
                if done is not None:
                    self._done.append(done)
                cond.notify_all()
            if done is not None and self.on_complete is not None:
                try:
                    self.on_complete()
                except Exception:  # a listener's failure must not end the tier's I/O
                    logger.exception("disk kv io completion listener failed")

    def _do(self, job: _Job) -> DiskCompletion | None:
        store = self.store
        try:
            if job.kind == WRITE:
                assert job.entry is not None and job.data is not None
                store.write(job.entry, job.data)
                return DiskCompletion(WRITE, job.block_hash, entry=job.entry)
            if job.kind == READ:
                return DiskCompletion(READ, job.block_hash, data=store.read(job.block_hash))
            store.delete(job.block_hash)
            return None
        except (OSError, ValueError) as exc:
            logger.warning("disk kv %s failed block=%016x reason=%s", job.kind, job.block_hash, exc)
            if job.kind == _DELETE:
                return None
            return DiskCompletion(job.kind, job.block_hash, entry=job.entry, error=str(exc))
