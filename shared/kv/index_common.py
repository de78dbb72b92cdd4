"""What every KV index implementation shares: its result type, event outcomes, and the event
dispatch built on its primitives (``store``, ``remove``, ``clear_worker``, ``dump``).

There are two implementations with identical behaviour (shared/kv/indexer.py picks one): the
pure-Python reference (index_python.py) and the compiled core (index_native.py). Keeping the
dispatch here means both apply a ``RouterEvent`` the same way by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dynamod.shared.protocol.kv_events import (
    KvCleared,
    KvEvent,
    KvRemoved,
    KvStored,
    RouterEvent,
    StoredBlock,
)

WorkerKey = tuple[int, int]
"""``(worker_id, dp_rank)``: the unit that holds a KV cache."""

# Outcomes of applying one event (also the ``outcome`` label of the router's event counter).
APPLIED = "applied"
PARENT_MISSING = "parent_missing"


@dataclass(slots=True)
class OverlapScores:
    """Result of ``find_matches``.

    ``scores``: leading blocks of the prompt held, for each worker key holding at least one.
    ``tree_sizes``: blocks held by every worker key the index knows (tie-breaking, explain).
    """

    scores: dict[WorkerKey, int]
    tree_sizes: dict[WorkerKey, int]


class KvIndexerBase:
    """Event dispatch and whole-worker operations on top of an implementation's primitives."""

    implementation = "abstract"

    def workers(self) -> list[WorkerKey]:
        raise NotImplementedError

    def store(self, worker: WorkerKey, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> str:
        raise NotImplementedError

    def remove(self, worker: WorkerKey, block_hashes: Iterable[int]) -> int:
        raise NotImplementedError

    def clear_worker(self, worker: WorkerKey) -> None:
        raise NotImplementedError

    def remove_worker_key(self, worker: WorkerKey) -> None:
        raise NotImplementedError

    def dump(self, worker: WorkerKey) -> list[KvStored]:
        raise NotImplementedError

    def apply_event(self, ev: RouterEvent) -> str:
        """Applies one router event; returns its outcome (``applied`` or ``parent_missing``)."""
        return self.apply(ev.worker_id, ev.dp_rank, ev.event)

    def apply_events(self, events: Iterable[RouterEvent]) -> int:
        """Applies a batch in order; returns how many were dropped for a missing parent."""
        dropped = 0
        apply = self.apply
        for ev in events:
            if apply(ev.worker_id, ev.dp_rank, ev.event) is not APPLIED:
                dropped += 1
        return dropped

    def apply(self, worker_id: int, dp_rank: int, event: KvEvent) -> str:
        cls = event.__class__
        if cls is KvStored:
            return self.store((worker_id, dp_rank), event.parent_hash, event.blocks)  # type: ignore[union-attr]
        if cls is KvRemoved:
            self.remove((worker_id, dp_rank), event.block_hashes)  # type: ignore[union-attr]
            return APPLIED
        if cls is KvCleared:
            self.clear_worker((worker_id, dp_rank))
            return APPLIED
        raise TypeError(f"not a KV event: {cls.__name__}")

    def remove_worker(self, worker_id: int) -> list[WorkerKey]:
        """Forgets every data-parallel rank of a worker (it left discovery). Returns the keys."""
        keys = [k for k in self.workers() if k[0] == worker_id]
        for key in keys:
            self.remove_worker_key(key)
        return keys

    def dump_events(self) -> list[RouterEvent]:
        """Every worker key's dump as router events (``event_id`` 0: a snapshot, not a stream)."""
        return [
            RouterEvent(worker_id=w, dp_rank=r, event_id=0, event=ev)
            for (w, r) in self.workers()
            for ev in self.dump((w, r))
        ]
