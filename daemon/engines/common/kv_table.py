"""The blocks a real engine holds now, as the router sees them, so ``kv_dump`` can answer.

vLLM and SGLang have no API that lists their cached blocks; they only stream changes. A router
that lost events (a gap in ``event_id``) re-reads the worker through ``kv_dump``, so the adapter
keeps this table, fed from the same converted events it publishes. It applies them with the
router index's own rules (shared/kv/indexer.py): a stored chain whose parent is unknown is dropped,
removing a block drops its descendants, ``cleared`` empties the rank. The dump therefore equals
what a router that saw every event would hold.

Blocks below the device (an offloading engine's host memory or disk, ``KvStored.medium``) are kept
in the router's own lower-tier structure (shared/kv/index_tiers.py), whose rules differ (a tier is
not prefix-closed; its parent may be a device block), so dumps carry every tier with its medium.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dynamod.shared.kv.hashing import chain_hash
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


@dataclass(slots=True)
class _Entry:
    parent: int | None
    tokens_hash: int
    lora_name: str | None
    node: int  # the router's prefix node (chained token hash), which lower-tier blocks hang from
    children: set[int] = field(default_factory=set)


class _RankTable:
    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks: dict[int, _Entry] = {}

    def store(self, ev: KvStored) -> None:
        parent = ev.parent_hash
        if parent is not None and parent not in self.blocks:
            return  # as the router: a chain under an unknown parent cannot be matched
        for block in ev.blocks:
            old = self.blocks.get(block.block_hash)
            if old is not None:
                if old.parent == parent and old.tokens_hash == block.tokens_hash:
                    parent = block.block_hash
                    continue
                self._drop(block.block_hash)  # the hash now names another block
            if parent is None:
                node = block.tokens_hash
            else:
                parent_entry = self.blocks[parent]
                parent_entry.children.add(block.block_hash)
                node = chain_hash(parent_entry.node, block.tokens_hash)
            self.blocks[block.block_hash] = _Entry(parent, block.tokens_hash, ev.lora_name, node)
            parent = block.block_hash

    def remove(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self.blocks:
                self._drop(h)

    def _drop(self, h: int) -> None:
        entry = self.blocks.pop(h)
        if entry.parent is not None:
            parent = self.blocks.get(entry.parent)
            if parent is not None:
                parent.children.discard(h)
        stack = list(entry.children)
        while stack:
            child = self.blocks.pop(stack.pop(), None)
            if child is not None:
                stack.extend(child.children)

    def dump(self) -> list[KvStored]:
        """Stored events, parents first; a run of single children travels as one chain."""
        out: list[KvStored] = []
        roots = [h for h, e in self.blocks.items() if e.parent is None]
        stack = [(None, h) for h in reversed(roots)]
        while stack:
            parent, h = stack.pop()
            entry = self.blocks[h]
            chain = [StoredBlock(h, entry.tokens_hash)]
            while len(entry.children) == 1:
                (h,) = entry.children
                entry = self.blocks[h]
                chain.append(StoredBlock(h, entry.tokens_hash))
            out.append(KvStored(parent_hash=parent, blocks=chain, lora_name=self.blocks[chain[0].block_hash].lora_name))
            stack.extend((h, c) for c in sorted(entry.children))
        return out


class KvBlockTable:
    """Per data-parallel rank: engine block hash -> (parent, router token hash, LoRA) on the
    device, plus the rank's lower-tier blocks."""

    def __init__(self) -> None:
        self._ranks: dict[int, _RankTable] = {}
        # Keyed (0, dp_rank): the structure is the router's, which keys by (worker, rank).
        self._lower = LowerTiers(self._device_node)

    def _device_node(self, key: tuple[int, int], block_hash: int) -> int | None:
        table = self._ranks.get(key[1])
        entry = table.blocks.get(block_hash) if table is not None else None
        return entry.node if entry is not None else None

    def _rank(self, dp_rank: int) -> _RankTable:
        table = self._ranks.get(dp_rank)
        if table is None:
            table = self._ranks[dp_rank] = _RankTable()
        return table

    def apply(self, dp_rank: int, event: KvEvent) -> None:
        key = (0, dp_rank)
        if isinstance(event, KvStored):
            if event.medium == MEDIUM_GPU:
                self._rank(dp_rank).store(event)
            elif event.medium in LOWER_MEDIA:
                self._lower.store(key, event.medium, event.parent_hash, event.blocks)
        elif isinstance(event, KvRemoved):
            if event.medium == MEDIUM_GPU:
                self._rank(dp_rank).remove(event.block_hashes)
            elif event.medium in LOWER_MEDIA:
                self._lower.remove(key, event.medium, event.block_hashes)
        elif isinstance(event, KvCleared):
            if event.medium in (None, MEDIUM_GPU):
                self._rank(dp_rank).blocks.clear()
            if event.medium is None or event.medium in LOWER_MEDIA:
                self._lower.clear(key, event.medium)

    def apply_all(self, events: Iterable[RouterEvent]) -> None:
        for ev in events:
            self.apply(ev.dp_rank, ev.event)

    def num_blocks(self, dp_rank: int | None = None, medium: str = MEDIUM_GPU) -> int:
        """Blocks held in one tier (the device by default), on one rank or all of them."""
        ranks = list(self._ranks) if dp_rank is None else [dp_rank]
        if medium == MEDIUM_GPU:
            return sum(len(self._ranks[r].blocks) for r in ranks if r in self._ranks)
        if dp_rank is None:
            ranks = [k[1] for k in self._lower.workers()]
        return sum(self._lower.sizes((0, r)).get(medium, 0) for r in ranks)

    def dump(self, worker_id: int, event_id: int) -> list[RouterEvent]:
        """Every held block as router events stamped with ``event_id`` (the last id published):
        per rank the device's chains, parents first, then the lower tiers' blocks."""
        ranks = sorted(set(self._ranks) | {k[1] for k in self._lower.workers()})
        return [
            RouterEvent(worker_id=worker_id, dp_rank=rank, event_id=event_id, event=stored)
            for rank in ranks
            for stored in [*(self._ranks[rank].dump() if rank in self._ranks else ()), *self._lower.dump((0, rank))]
        ]
