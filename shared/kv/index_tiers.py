"""The router's view of each worker's KV blocks *below* its device cache: host memory, then disk.

Engines with KV offloading (vLLM's offloading connector, our mocker's host and disk tiers) move
blocks between tiers and say so in their events (``KvStored.medium`` / ``KvRemoved.medium``). The
device tier stays in the radix index (index_python.py / index_native.py) exactly as before; this
class, shared by both implementations so they behave the same by construction, holds the rest.

Why a separate structure rather than more holders in the radix tree: the tree keeps every
holder's held set prefix-closed, but a lower tier is not. A block offloaded to host memory usually
continues a prefix whose first blocks are still on the device (the parent is named by the device
tier, not the host tier), and removing a host block does not make the engine drop the host blocks
after it. So here a tier is a plain set of prefix nodes per worker key, the node of a block being
the same chained sequence hash the tree uses; a stored block's parent is looked up in the worker's
lower tiers and then on its device (``node_of_device``).

Matching (``continuation``): after the device prefix of ``g`` blocks, the worker's *continuation*
is the longest run of the prompt's next blocks each held in some lower tier; each block of it is
counted once, in the fastest lower tier holding it (host before disk). A block on the device after
a gap is not in the device tree (prefix-closed), so it cannot be counted twice.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Sequence

import xxhash

from dynamod.shared.kv.hashing import KV_HASH_SEED
from dynamod.shared.protocol.kv_events import MEDIUM_CPU, MEDIUM_DISK, KvStored, StoredBlock

logger = logging.getLogger(__name__)

LOWER_MEDIA = (MEDIUM_CPU, MEDIUM_DISK)
"""The lower tiers, fastest first (the order of ``continuation``'s counts)."""
_TIER = {m: i for i, m in enumerate(LOWER_MEDIA)}
_NT = len(LOWER_MEDIA)
_SLOT_MASK = (1 << _NT) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack

WorkerKey = tuple[int, int]
NodeOf = Callable[[WorkerKey, int], "int | None"]


class _Tier:
    """One worker key's blocks in one lower tier."""

    __slots__ = ("by_hash", "names", "key", "parent_name")

    def __init__(self) -> None:
        self.by_hash: dict[int, int] = {}  # engine hash -> node
        self.names: dict[int, list[int]] = {}  # node -> its engine hashes (usually one)
        self.key: dict[int, int] = {}  # node -> its block's local tokens hash (dumps)
        self.parent_name: dict[int, int | None] = {}  # node -> the parent engine hash it was stored under


class _WorkerTiers:
    __slots__ = ("slot", "tiers")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.tiers = tuple(_Tier() for _ in LOWER_MEDIA)


class LowerTiers:
    """Blocks per worker key in each lower tier (``LOWER_MEDIA``). Not thread-safe, like the index."""

    def __init__(self, node_of_device: NodeOf) -> None:
        self._node_of_device = node_of_device
        self._mask: dict[int, int] = {}  # node -> bits (slot * _NT + tier) of the holders
        self._workers: dict[WorkerKey, _WorkerTiers] = {}
        self._key_of_slot: dict[int, WorkerKey] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.blocks = 0  # held blocks over every worker and tier (0: matching skips this class)

    # ------------------------------------------------------------------------------------------
    # Introspection.

    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    def sizes(self, worker: WorkerKey) -> dict[str, int]:
        """Blocks ``worker`` holds per lower tier (every tier named, 0 when none)."""
        wt = self._workers.get(worker)
        if wt is None:
            return {m: 0 for m in LOWER_MEDIA}
        return {m: len(t.names) for m, t in zip(LOWER_MEDIA, wt.tiers, strict=True)}

    def holds(self, worker: WorkerKey, medium: str, block_hash: int) -> bool:
        wt = self._workers.get(worker)
        return wt is not None and block_hash in wt.tiers[_TIER[medium]].by_hash

    def check_invariants(self) -> None:
        """Asserts the structure is consistent (tests)."""
        expect: dict[int, int] = {}
        total = 0
        for wt in self._workers.values():
            for ti, tier in enumerate(wt.tiers):
                bit = 1 << (wt.slot * _NT + ti)
                assert set(tier.by_hash.values()) == set(tier.names) == set(tier.key) == set(tier.parent_name)
                for node, names in tier.names.items():
                    assert names and all(tier.by_hash[n] == node for n in names)
                    expect[node] = expect.get(node, 0) | bit
                total += len(tier.names)
        assert expect == self._mask and total == self.blocks

    # ------------------------------------------------------------------------------------------
    # Events.

    def store(self, worker: WorkerKey, medium: str, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> bool:
        """``KvStored`` into a lower tier. False (nothing stored) when the parent is unknown in
        every tier of the worker."""
        wt = self._workers.get(worker) or self._register(worker)
        ti = _TIER[medium]
        if parent_hash is None:
            parent: int | None = None
        else:
            parent = self._node_of(worker, wt, ti, parent_hash)
            if parent is None:
                logger.debug("kv stored parent missing worker=%s medium=%s parent_hash=%d", worker, medium, parent_hash)
                return False
        tier = wt.tiers[ti]
        bit = 1 << (wt.slot * _NT + ti)
        masks = self._mask
        parent_name = parent_hash
        for blk in blocks:
            key = blk.tokens_hash
            ext = blk.block_hash
            s = key if parent is None else _xxh3(_pack_pair(parent, key), KV_HASH_SEED)
            old = tier.by_hash.get(ext)
            if old is not None and old != s:  # the name moves to another block: drop the old one
                self._drop(tier, bit, old)
            names = tier.names.get(s)
            if names is None:
                tier.names[s] = [ext]
                tier.key[s] = key
                tier.parent_name[s] = parent_name
                masks[s] = masks.get(s, 0) | bit
                self.blocks += 1
            elif ext not in names:
                names.append(ext)
            tier.by_hash[ext] = s
            parent = s
            parent_name = ext
        return True

    def remove(self, worker: WorkerKey, medium: str, block_hashes: Iterable[int]) -> int:
        """``KvRemoved`` from a lower tier: only the named blocks leave (the engine keeps the
        rest of the tier). Returns how many blocks the tier no longer holds."""
        wt = self._workers.get(worker)
        if wt is None:
            return 0
        ti = _TIER[medium]
        tier = wt.tiers[ti]
        bit = 1 << (wt.slot * _NT + ti)
        removed = 0
        for ext in block_hashes:
            node = tier.by_hash.get(ext)
            if node is not None:
                self._drop(tier, bit, node)
                removed += 1
        return removed

    def clear(self, worker: WorkerKey, medium: str | None = None) -> None:
        """``KvCleared`` of one lower tier, or of all of them (``medium`` None)."""
        wt = self._workers.get(worker)
        if wt is None:
            return
        for ti, tier in enumerate(wt.tiers):
            if medium is None or LOWER_MEDIA[ti] == medium:
                bit = 1 << (wt.slot * _NT + ti)
                for node in list(tier.names):
                    self._drop(tier, bit, node)

    def remove_worker_key(self, worker: WorkerKey) -> None:
        wt = self._workers.get(worker)
        if wt is None:
            return
        self.clear(worker)
        del self._workers[worker]
        del self._key_of_slot[wt.slot]
        self._free_slots.append(wt.slot)

    # ------------------------------------------------------------------------------------------
    # Queries.

    def continuation(self, seq_hashes: Sequence[int], device: dict[WorkerKey, int]) -> dict[WorkerKey, tuple[int, ...]]:
        """Per worker key with a lower-tier continuation of the prompt: its blocks counted per
        lower tier (``LOWER_MEDIA`` order), after its device prefix ``device[worker]`` (0 when
        absent). Workers with no continuation are left out."""
        out: dict[WorkerKey, tuple[int, ...]] = {}
        if not self.blocks:
            return out
        n = len(seq_hashes)
        groups: dict[int, int] = {}  # device depth -> slots' bits starting there
        device_get = device.get
        for worker, wt in self._workers.items():
            g = device_get(worker, 0)
            if g < n:
                groups[g] = groups.get(g, 0) | (_SLOT_MASK << (wt.slot * _NT))
        mask_get = self._mask.get
        key_of_slot = self._key_of_slot
        for start, alive in groups.items():
            counts: dict[int, list[int]] = {}
            run_mask = -1  # no run yet: the first block always starts one (or ends the walk)
            run_start = start
            i = start
            while i < n:
                m = mask_get(seq_hashes[i], 0) & alive
                if m != run_mask:
                    _flush(run_mask, i - run_start, counts)
                    if not m:
                        run_mask = 0
                        break
                    run_mask = m
                    run_start = i
                    alive = _slots_of(m)  # a worker missing this block has ended its run
                i += 1
            _flush(run_mask, i - run_start, counts)
            for slot, c in counts.items():
                out[key_of_slot[slot]] = tuple(c)
        return out

    # ------------------------------------------------------------------------------------------
    # Snapshots.

    def dump(self, worker: WorkerKey) -> list[KvStored]:
        """The worker's lower-tier blocks as ``KvStored`` events (one block each, with its tier),
        ordered so that a block comes after any lower-tier block its parent name refers to; to be
        applied after the device tier's dump."""
        wt = self._workers.get(worker)
        if wt is None:
            return []
        entries: list[tuple[str, int, int, int | None]] = []  # (medium, ext, key, parent name)
        for medium, tier in zip(LOWER_MEDIA, wt.tiers, strict=True):
            for node, names in tier.names.items():
                entries.extend((medium, ext, tier.key[node], tier.parent_name[node]) for ext in names)
        waiting: dict[int, list[int]] = {}  # name -> entries whose parent it is
        named = {e[1] for e in entries}
        ready: list[int] = []
        for i, (_, _, _, parent) in enumerate(entries):
            if parent is not None and parent in named:
                waiting.setdefault(parent, []).append(i)
            else:
                ready.append(i)
        out: list[KvStored] = []
        done: set[int] = set()
        while ready:
            i = ready.pop()
            medium, ext, key, parent = entries[i]
            out.append(KvStored(parent_hash=parent, blocks=[StoredBlock(ext, key)], medium=medium))
            done.add(i)
            ready.extend(waiting.pop(ext, ()))
        for i, (medium, ext, key, parent) in enumerate(entries):  # cycles (renamed blocks): as is
            if i not in done:
                out.append(KvStored(parent_hash=parent, blocks=[StoredBlock(ext, key)], medium=medium))
        return out

    # ------------------------------------------------------------------------------------------
    # Internals.

    def _node_of(self, worker: WorkerKey, wt: _WorkerTiers, ti: int, ext: int) -> int | None:
        """The node an engine hash names for this worker: its tier first, the other lower tiers,
        then the device."""
        node = wt.tiers[ti].by_hash.get(ext)
        if node is not None:
            return node
        for tj, tier in enumerate(wt.tiers):
            if tj != ti:
                node = tier.by_hash.get(ext)
                if node is not None:
                    return node
        return self._node_of_device(worker, ext)

    def _drop(self, tier: _Tier, bit: int, node: int) -> None:
        for ext in tier.names.pop(node):
            del tier.by_hash[ext]
        del tier.key[node]
        del tier.parent_name[node]
        mask = self._mask[node] & ~bit
        if mask:
            self._mask[node] = mask
        else:
            del self._mask[node]
        self.blocks -= 1

    def _register(self, worker: WorkerKey) -> _WorkerTiers:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
        wt = self._workers[worker] = _WorkerTiers(slot)
        self._key_of_slot[slot] = worker
        return wt


def _slots_of(bits: int) -> int:
    """Every tier bit of each slot that has at least one bit in ``bits``."""
    out = 0
    while bits:
        low = bits & -bits
        slot = (low.bit_length() - 1) // _NT
        whole = _SLOT_MASK << (slot * _NT)
        out |= whole
        bits &= ~whole
    return out


def _flush(mask: int, length: int, counts: dict[int, list[int]]) -> None:
    """Adds a run of ``length`` blocks with the same holders: each slot's fastest tier."""
    if not length:
        return
    while mask:
        low = mask & -mask
        index = low.bit_length() - 1
        slot, tier = divmod(index, _NT)
        c = counts.get(slot)
        if c is None:
            c = counts[slot] = [0] * _NT
        c[tier] += length
        mask &= ~(_SLOT_MASK << (slot * _NT))
