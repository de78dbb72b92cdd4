"""The router's credit for pinned prefixes (``cache_control``): a prefix pinned on a worker counts
as cached there until its pin's TTL ends, whatever the KV events say.

A worker keeps a pinned prefix resident (the mocker's pool holds it by reference; pins.py), so the
router can rely on it even when the events announcing it were lost (an event-plane outage, a gap
waiting for its ``kv_dump``) or when it routes in approximate mode, whose own TTL may be shorter
than the pin's. The credit is recorded when a request with a pin is routed, as approximate mode
records its guesses: the pin is assumed to take (a worker whose pinned share is full refuses it,
and the credit then overstates that worker's cache until the TTL ends).

Built on approximate mode's index (shared/kv/approx.py), one per TTL class, because that index
expires in refresh order and so needs one TTL per instance: TTLs are grouped by whole minutes from
60 s up (rounded down, so a credit never outlives its pin) and kept exact below, a bounded number
of classes. Routing takes, per worker, the longer of the prefix the KV index knows and the pinned
one (``kv_router._best_of``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from dynamod.shared.kv.approx import ApproxKvIndexer
from dynamod.shared.kv.indexer import OverlapScores, WorkerKey

MAX_PINNED_TREE_BLOCKS = 1 << 18  # per TTL class; the oldest credits are pruned beyond it


def ttl_class(ttl_s: float) -> float:
    """The TTL a credit is kept for: exact whole seconds under a minute, whole minutes above."""
    seconds = math.floor(ttl_s)
    return float(seconds if seconds < 60 else seconds // 60 * 60)


class PinnedPrefixes:
    """Pinned prefixes per worker, each credited until its pin's TTL (refreshed by a later pin)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, max_tree_size: int = MAX_PINNED_TREE_BLOCKS) -> None:
        self._clock = clock
        self._max_tree_size = max_tree_size
        self._by_ttl: dict[float, ApproxKvIndexer] = {}

    def __bool__(self) -> bool:
        return bool(self._by_ttl)

    def record(self, worker: WorkerKey, local_hashes: Sequence[int], seq_hashes: Sequence[int], ttl_s: float) -> None:
        """``worker`` now holds these blocks (a prompt prefix, whole blocks) pinned for ``ttl_s``."""
        ttl = ttl_class(ttl_s)
        if ttl <= 0 or not local_hashes:
            return
        index = self._by_ttl.get(ttl)
        if index is None:
            index = self._by_ttl[ttl] = ApproxKvIndexer(ttl_s=ttl, max_tree_size=self._max_tree_size, clock=self._clock)
        index.record(worker, local_hashes, seq_hashes)

    def find_matches_sequence(self, seq_hashes: Sequence[int]) -> OverlapScores | None:
        """Per worker, the longest pinned prefix of the request (None: nothing pinned matches)."""
        best: dict[WorkerKey, int] = {}
        for index in self._by_ttl.values():
            for worker, blocks in index.find_matches_sequence(seq_hashes).scores.items():
                if blocks > best.get(worker, 0):
                    best[worker] = blocks
        return OverlapScores(best, {}, {}) if best else None

    def remove_worker(self, worker_id: int) -> None:
        for index in self._by_ttl.values():
            index.remove_worker(worker_id)

    def pinned_blocks(self) -> int:
        """Credited blocks (a prefix pinned under two TTLs counts twice)."""
        return sum(index.indexer.total_blocks for index in self._by_ttl.values())
