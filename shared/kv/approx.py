"""Approximate mode: a KV index fed by the router's own decisions instead of engine events.

Without KV events (``--no-router-kv-events``) the router assumes the worker it chose now caches the
request's blocks, for ``ttl_s`` seconds after the last request that touched them (Dynamo's
behaviour). The blocks go into an ordinary ``KvIndexer`` under their chained sequence hashes as
engine hashes (unique per prefix), so expiry and pruning are plain removals.

Each worker key keeps an ``OrderedDict`` block -> deadline in refresh order. Deadlines are
``now + ttl`` with a monotonic clock, so that order is also deadline order, and within one request
a parent precedes its children: expiring or pruning from the front removes a prefix's tail no later
than its head, and removing a head takes its (equally old) tail with it. When the index exceeds
``max_tree_size`` blocks it is pruned, oldest first across workers, down to
``prune_target_ratio * max_tree_size``. The clock is injected so tests and simulated-time trace
replays control expiry.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from dynamod.shared.kv.indexer import KvIndexer, OverlapScores, WorkerKey

logger = logging.getLogger(__name__)


class ApproxKvIndexer:
    def __init__(
        self,
        *,
        ttl_s: float = 120.0,
        max_tree_size: int = 1 << 20,
        prune_target_ratio: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        indexer: KvIndexer | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be positive, got {max_tree_size}")
        if not 0.0 <= prune_target_ratio <= 1.0:
            raise ValueError(f"prune_target_ratio must be within [0, 1], got {prune_target_ratio}")
        self.ttl_s = ttl_s
        self.max_tree_size = max_tree_size
        self.prune_target = int(max_tree_size * prune_target_ratio)
        self._clock = clock
        self.indexer = indexer if indexer is not None else KvIndexer()
        self._deadlines: dict[WorkerKey, OrderedDict[int, float]] = {}
        self._next_deadline = math.inf  # no entry expires before this

    def record(self, worker: WorkerKey, local_hashes: Sequence[int], seq_hashes: Sequence[int]) -> None:
        """The request with these blocks was routed to ``worker``: assume it caches them now."""
        if not local_hashes:
            return
        self.indexer.store_chain(worker, local_hashes, seq_hashes)
        deadline = self._clock() + self.ttl_s
        entries = self._deadlines.get(worker)
        if entries is None:
            entries = self._deadlines[worker] = OrderedDict()
        move = entries.move_to_end
        for h in seq_hashes:
            entries[h] = deadline
            move(h)
        if deadline < self._next_deadline:
            self._next_deadline = deadline
        if self.indexer.total_blocks > self.max_tree_size:
            self.prune()

    def expire(self, now: float | None = None) -> int:
        """Removes every block whose TTL has passed; returns how many blocks were dropped."""
        if now is None:
            now = self._clock()
        if now < self._next_deadline:
            return 0
        before = self.indexer.total_blocks
        next_deadline = math.inf
        for worker, entries in self._deadlines.items():
            expired: list[int] = []
            while entries:
                h, deadline = next(iter(entries.items()))
                if deadline > now:
                    next_deadline = min(next_deadline, deadline)
                    break
                entries.popitem(last=False)
                expired.append(h)
            if expired:
                self.indexer.remove(worker, expired)
        self._next_deadline = next_deadline
        dropped = before - self.indexer.total_blocks
        if dropped:
            logger.debug("approx kv expired blocks=%d remaining=%d", dropped, self.indexer.total_blocks)
        return dropped

    def prune(self) -> int:
        """Drops the oldest blocks across workers until the index is at the prune target."""
        before = self.indexer.total_blocks
        target = self.prune_target
        popped: list[tuple[WorkerKey, int]] = []
        indexer = self.indexer
        for _deadline, _order, worker, h in heapq.merge(*(self._oldest_first(w) for w in self._deadlines)):
            if indexer.total_blocks <= target and indexer.holds(worker, h):
                break  # at target; entries of blocks already gone with their head are swept too
            popped.append((worker, h))
            indexer.remove(worker, (h,))
        for worker, h in popped:
            self._deadlines[worker].pop(h, None)
        dropped = before - self.indexer.total_blocks
        logger.info("approx kv pruned blocks=%d remaining=%d target=%d", dropped, self.indexer.total_blocks, target)
        return dropped

    def _oldest_first(self, worker: WorkerKey) -> Iterator[tuple[float, int, WorkerKey, int]]:
        # The position breaks deadline ties so a parent (earlier in its request) goes first.
        for order, (h, deadline) in enumerate(list(self._deadlines[worker].items())):
            yield deadline, order, worker, h

    def find_matches(self, local_hashes: Sequence[int]) -> OverlapScores:
        self.expire()
        return self.indexer.find_matches(local_hashes)

    def find_matches_sequence(self, seq_hashes: Sequence[int]) -> OverlapScores:
        self.expire()
        return self.indexer.find_matches_sequence(seq_hashes)

    def remove_worker(self, worker_id: int) -> None:
        self.indexer.remove_worker(worker_id)
        for key in [k for k in self._deadlines if k[0] == worker_id]:
            del self._deadlines[key]

    def tracked_blocks(self) -> int:
        """Entries awaiting expiry (>= held blocks: a removed head's tail waits to be popped)."""
        return sum(len(e) for e in self._deadlines.values())
