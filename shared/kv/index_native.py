"""The KV index on the compiled core (shared/kv/_native/kvcore.c): same behaviour as the
pure-Python reference (index_python.py), at a fraction of the cost per block.

The C core knows holders only by number (their bit in the per-node masks); this class maps worker
keys to holders and turns the core's answers into the shared result types. The core keeps the
``{worker key: blocks held}`` dict itself, so ``find_matches`` copies it without a Python loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from types import ModuleType

from dynamod.shared.kv import native
from dynamod.shared.kv.index_common import APPLIED, PARENT_MISSING, KvIndexerBase, OverlapScores, WorkerKey
from dynamod.shared.kv.index_tiers import LowerTiers
from dynamod.shared.protocol.kv_events import KvStored, StoredBlock

logger = logging.getLogger(__name__)


class NativeKvIndexer(KvIndexerBase):
    """Radix index of cached blocks per worker key, on the compiled core. Not thread-safe: one
    owner applies events and answers queries (the router's event loop)."""

    implementation = "native"

    def __init__(self, core: ModuleType | None = None) -> None:
        if core is None:
            if native.core is None:
                raise RuntimeError(f"the compiled KV core is not available: {native.unavailable_reason}")
            core = native.core
        self._index = core.Index()
        self._holder: dict[WorkerKey, int] = {}
        self._sizes: dict[WorkerKey, int] = self._index.sizes  # kept up to date by the core
        self._collisions = 0
        self._core = core
        self.tiers = LowerTiers(self.device_node_of)

    # ------------------------------------------------------------------------------------------
    # Introspection.

    def workers(self) -> list[WorkerKey]:
        """Worker keys the index holds state for."""
        return list(self._holder)

    @property
    def total_blocks(self) -> int:
        """Blocks held, summed over worker keys (a block held by two workers counts twice)."""
        return self._index.total

    def num_nodes(self) -> int:
        """Distinct blocks in the tree."""
        return self._index.num_nodes()

    def memory_bytes(self) -> int:
        """Bytes allocated by the index's tables."""
        return self._index.memory_bytes()

    def holds(self, worker: WorkerKey, block_hash: int) -> bool:
        """Whether ``worker`` holds a block it named ``block_hash``."""
        holder = self._holder.get(worker)
        return holder is not None and self._index.holds(holder, block_hash)

    def device_node_of(self, worker: WorkerKey, block_hash: int) -> int | None:
        holder = self._holder.get(worker)
        return None if holder is None else self._index.node_hash(holder, block_hash)

    def check_invariants(self) -> None:
        """Asserts the structure is consistent (tests and debugging; walks everything)."""
        self.tiers.check_invariants()
        self._index.check()
        assert set(self._holder) == set(self._sizes)

    # ------------------------------------------------------------------------------------------
    # Queries.

    def find_matches(self, local_hashes: Iterable[int]) -> OverlapScores:
        """Per worker key, how many leading blocks of the prompt (its local hashes) it holds."""
        if not isinstance(local_hashes, list | tuple):
            local_hashes = list(local_hashes)
        if self.tiers.blocks:  # lower tiers need the whole chain
            return self.find_matches_sequence(self._core.sequence_hashes(local_hashes))
        return OverlapScores(self._index.match_local(local_hashes), self._sizes.copy())

    def find_matches_sequence(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """``find_matches`` for a prompt whose chained sequence hashes are already computed."""
        result = OverlapScores(self._index.match_seq(seq_hashes), self._sizes.copy())
        if self.tiers.blocks:
            result.lower = self.tiers.continuation(seq_hashes, result.scores)
        return result

    # ------------------------------------------------------------------------------------------
    # Events.

    def store(self, worker: WorkerKey, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> str:
        """``KvStored``: the worker now holds ``blocks``, a chain under ``parent_hash``."""
        holder = self._holder.get(worker)
        if holder is None:
            holder = self._register(worker)
        index = self._index
        if not index.store(holder, parent_hash, blocks):
            logger.debug("kv stored parent missing worker=%s parent_hash=%d", worker, parent_hash)
            return PARENT_MISSING
        if index.collisions != self._collisions:
            self._collisions = index.collisions
            logger.warning("kv block hash reused for another block worker=%s", worker)
        return APPLIED

    def store_chain(
        self,
        worker: WorkerKey,
        tokens_hashes: Sequence[int],
        seq_hashes: Sequence[int],
        block_hashes: Sequence[int] | None = None,
    ) -> None:
        """Stores a prompt's chain from the root, its sequence hashes already computed.
        ``block_hashes`` default to the sequence hashes (approximate mode names blocks so)."""
        holder = self._holder.get(worker)
        if holder is None:
            holder = self._register(worker)
        self._index.store_chain(holder, seq_hashes if block_hashes is None else block_hashes, tokens_hashes, seq_hashes)

    def remove(self, worker: WorkerKey, block_hashes: Iterable[int]) -> int:
        """``KvRemoved``: the worker dropped these blocks (and so their descendants). Returns the
        number of blocks it no longer holds."""
        holder = self._holder.get(worker)
        if holder is None:
            return 0
        return self._index.remove(holder, block_hashes)

    def clear_worker(self, worker: WorkerKey) -> None:
        """``KvCleared``: the worker holds nothing (its key stays registered)."""
        holder = self._holder.get(worker)
        if holder is not None:
            self._index.clear(holder)

    def remove_worker_key(self, worker: WorkerKey) -> None:
        holder = self._holder.pop(worker, None)
        if holder is not None:
            self._index.unregister(holder)

    # ------------------------------------------------------------------------------------------
    # Snapshots.

    def dump(self, worker: WorkerKey) -> list[KvStored]:
        """The worker's blocks as ``KvStored`` events, parents before children, such that
        applying them to an empty index rebuilds the same held blocks and the same names."""
        holder = self._holder.get(worker)
        if holder is None:
            return []
        chains, extras = self._index.dump(holder)
        out = [KvStored(parent_hash=parent, blocks=[StoredBlock(e, k) for e, k in chain]) for parent, chain in chains]
        out.extend(KvStored(parent_hash=parent, blocks=[StoredBlock(e, k)]) for parent, e, k in extras)
        return out

    def _register(self, worker: WorkerKey) -> int:
        holder = self._holder[worker] = self._index.register(worker)
        return holder
