"""The blocks a real engine holds now, as the router sees them, so ``kv_dump`` can answer.

vLLM and SGLang have no API that lists their cached blocks; they only stream changes. A router
that lost events (a gap in ``event_id``) re-reads the worker through ``kv_dump``, so the adapter
keeps this table, fed from the same converted events it publishes. It applies them with the
router index's own rules (shared/kv/indexer.py): a stored chain whose parent is unknown is dropped,
removing a block drops its descendants, ``cleared`` empties the rank. The dump therefore equals
what a router that saw every event would hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dynamod.shared.protocol.kv_events import (
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
            self.blocks[block.block_hash] = _Entry(parent, block.tokens_hash, ev.lora_name)
            if parent is not None:
                self.blocks[parent].children.add(block.block_hash)
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
    """Per data-parallel rank: engine block hash -> (parent, router token hash, LoRA)."""

    def __init__(self) -> None:
        self._ranks: dict[int, _RankTable] = {}

    def apply(self, dp_rank: int, event: KvEvent) -> None:
        table = self._ranks.get(dp_rank)
        if table is None:
            table = self._ranks[dp_rank] = _RankTable()
        if isinstance(event, KvStored):
            table.store(event)
        elif isinstance(event, KvRemoved):
            table.remove(event.block_hashes)
        elif isinstance(event, KvCleared):
            table.blocks.clear()

    def apply_all(self, events: Iterable[RouterEvent]) -> None:
        for ev in events:
            self.apply(ev.dp_rank, ev.event)

    def num_blocks(self, dp_rank: int | None = None) -> int:
        if dp_rank is not None:
            table = self._ranks.get(dp_rank)
            return len(table.blocks) if table else 0
        return sum(len(t.blocks) for t in self._ranks.values())

    def dump(self, worker_id: int, event_id: int) -> list[RouterEvent]:
        """Every held block as router events stamped with ``event_id`` (the last id published)."""
        return [
            RouterEvent(worker_id=worker_id, dp_rank=rank, event_id=event_id, event=stored)
            for rank in sorted(self._ranks)
            for stored in self._ranks[rank].dump()
        ]
