"""What every KV index implementation shares: its result type, event outcomes, and the event
dispatch built on its primitives (``store``, ``remove``, ``clear_worker``, ``dump``).

There are two implementations with identical behaviour (shared/kv/indexer.py picks one): the
pure-Python reference (index_python.py) and the compiled core (index_native.py). Keeping the
dispatch here means both apply a ``RouterEvent`` the same way by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamod.shared.kv.index_tiers import LOWER_MEDIA, LowerTiers
from dynamod.shared.protocol.kv_events import (
    MEDIUM_GPU,
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
UNKNOWN_MEDIUM = "unknown_medium"  # a tier this index does not know (dropped)


@dataclass(slots=True)
class OverlapScores:
    """Result of ``find_matches``.

    ``scores``: leading blocks of the prompt held on the device (GPU tier), for each worker key
    holding at least one: the overlap as it always was.
    ``tree_sizes``: device blocks held by every worker key the index knows (tie-breaking, explain).
    ``lower``: for worker keys whose device prefix continues in lower tiers, the continuation's
    blocks per lower tier, ``LOWER_MEDIA`` order (host, disk); see shared/kv/index_tiers.py.
    """

    scores: dict[WorkerKey, int]
    tree_sizes: dict[WorkerKey, int]
    lower: dict[WorkerKey, tuple[int, ...]] = field(default_factory=dict)

    def by_medium(self, worker: WorkerKey) -> dict[str, int]:
        """The worker's overlap per tier: ``{"GPU": device prefix, "CPU": ..., "DISK": ...}``."""
        out = {MEDIUM_GPU: self.scores.get(worker, 0)}
        out.update(zip(LOWER_MEDIA, self.lower.get(worker, (0,) * len(LOWER_MEDIA)), strict=True))
        return out


class KvIndexerBase(ABC):
    """Event dispatch and whole-worker operations on top of an implementation's primitives."""

    implementation = "abstract"
    tiers: LowerTiers  # blocks below the device cache (set by each implementation's __init__)
    _sizes: dict[WorkerKey, int]  # device blocks per worker key (kept by each implementation)

    def tree_size(self, worker: WorkerKey) -> int:
        """Blocks held by ``worker`` (0 when unknown)."""
        return self._sizes.get(worker, 0)

    def tree_sizes(self) -> dict[WorkerKey, int]:
        return self._sizes.copy()

    @abstractmethod
    def workers(self) -> list[WorkerKey]:
        ...

    @abstractmethod
    def device_node_of(self, worker: WorkerKey, block_hash: int) -> int | None:
        """The prefix node (sequence hash) a device block name stands for, or None."""
        ...

    @abstractmethod
    def store(self, worker: WorkerKey, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> str:
        ...

    @abstractmethod
    def remove(self, worker: WorkerKey, block_hashes: Iterable[int]) -> int:
        ...

    @abstractmethod
    def clear_worker(self, worker: WorkerKey) -> None:
        ...

    @abstractmethod
    def remove_worker_key(self, worker: WorkerKey) -> None:
        ...

    @abstractmethod
    def dump(self, worker: WorkerKey) -> list[KvStored]:
        ...

    def tier_sizes(self, worker: WorkerKey) -> dict[str, int]:
        """Blocks ``worker`` holds per tier: ``{"GPU": n, "CPU": n, "DISK": n}``."""
        out = {MEDIUM_GPU: self.tree_size(worker)}  # type: ignore[attr-defined]
        out.update(self.tiers.sizes(worker))
        return out

    def apply_event(self, ev: RouterEvent) -> str:
        """Applies one router event; returns its outcome (``applied``, ``parent_missing`` or
        ``unknown_medium``)."""
        return self.apply(ev.worker_id, ev.dp_rank, ev.event)

    def apply_events(self, events: Iterable[RouterEvent]) -> int:
        """Applies a batch in order; returns how many were dropped (missing parent, unknown tier)."""
        dropped = 0
        apply = self.apply
        for ev in events:
            if apply(ev.worker_id, ev.dp_rank, ev.event) is not APPLIED:
                dropped += 1
        return dropped

    def apply(self, worker_id: int, dp_rank: int, event: KvEvent) -> str:
        cls = event.__class__
        if cls is KvStored:
            medium = event.medium  # type: ignore[union-attr]
            if medium == MEDIUM_GPU:
                return self.store((worker_id, dp_rank), event.parent_hash, event.blocks)  # type: ignore[union-attr]
            if medium not in LOWER_MEDIA:
                return UNKNOWN_MEDIUM
            ok = self.tiers.store((worker_id, dp_rank), medium, event.parent_hash, event.blocks)  # type: ignore[union-attr]
            return APPLIED if ok else PARENT_MISSING
        if cls is KvRemoved:
            medium = event.medium  # type: ignore[union-attr]
            if medium == MEDIUM_GPU:
                self.remove((worker_id, dp_rank), event.block_hashes)  # type: ignore[union-attr]
            elif medium in LOWER_MEDIA:
                self.tiers.remove((worker_id, dp_rank), medium, event.block_hashes)  # type: ignore[union-attr]
            else:
                return UNKNOWN_MEDIUM
            return APPLIED
        if cls is KvCleared:
            medium = event.medium  # type: ignore[union-attr]
            if medium is None or medium == MEDIUM_GPU:
                self.clear_worker((worker_id, dp_rank))
            if medium is None or medium in LOWER_MEDIA:
                self.tiers.clear((worker_id, dp_rank), medium)
            elif medium != MEDIUM_GPU:
                return UNKNOWN_MEDIUM
            return APPLIED
        raise TypeError(f"not a KV event: {cls.__name__}")

    def remove_worker(self, worker_id: int) -> list[WorkerKey]:
        """Forgets every data-parallel rank and every tier of a worker (it left discovery).
        Returns the keys."""
        keys = list(dict.fromkeys(k for k in [*self.workers(), *self.tiers.workers()] if k[0] == worker_id))
        for key in keys:
            self.remove_worker_key(key)
            self.tiers.remove_worker_key(key)
        return keys

    def dump_events(self) -> list[RouterEvent]:
        """Every worker key's dump, device tier then lower tiers, as router events (``event_id``
        0: a snapshot, not a stream)."""
        keys = list(dict.fromkeys([*self.workers(), *self.tiers.workers()]))
        return [
            RouterEvent(worker_id=w, dp_rank=r, event_id=0, event=ev)
            for (w, r) in keys
            for ev in [*self.dump((w, r)), *self.tiers.dump((w, r))]
        ]
