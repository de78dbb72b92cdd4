"""The pure-Python KV index: the reference implementation and the fallback when the compiled core
(index_native.py) is not built. Semantics: shared/kv/indexer.py.

A radix tree over prompt prefixes, in blocks. A node *is* a prefix: it is identified by the
chained sequence hash of its blocks' local hashes (``tokens_hash``; shared/kv/hashing.py), the
same chain the router computes for every request anyway. A prompt's overlap with each worker is
found by walking its sequence hashes from the root. Engines name their blocks by their own hashes
(``block_hash``), which the router cannot compute, so each worker key ``(worker_id, dp_rank)``
keeps a map engine hash -> node; a later ``KvRemoved`` finds its node through it.

Why it is fast enough in pure Python:

- Each node carries an integer bitmask of the worker keys holding it. Held sets are prefix-closed,
  so along a prompt the masks only shrink: matching never loops over workers and decodes worker
  bits only where the mask shrinks. With the prompt's sequence hashes at hand (the router's
  case) it gallops, looking up O(changes x log gap) nodes rather than one per block.
- The tree is a handful of flat ``dict[int, int]`` (mask, parent, local hash, first child and
  sibling links), not node objects. Ints are not tracked by Python's cyclic garbage collector, so
  a million-block index adds nothing to GC passes and applying events allocates no tracked
  objects: no collection pauses while the tree churns, and no GC cost on the event path.
- Nodes nobody holds are unlinked at once, so the tree never carries dead weight.
"""


from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Sequence

import xxhash

from dynamod.shared.kv.hashing import KV_HASH_SEED, compute_sequence_hashes
from dynamod.shared.kv.index_common import APPLIED, PARENT_MISSING, KvIndexerBase, OverlapScores, WorkerKey
from dynamod.shared.kv.index_tiers import LowerTiers
from dynamod.shared.protocol.kv_events import KvStored, StoredBlock

logger = logging.getLogger(__name__)

_ROOT = -1  # parent of first blocks (sequence hashes are unsigned, so never -1)
_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack


class _Holder:
    """Per worker key: its bit, and both directions of the engine hash <-> node naming."""

    __slots__ = ("bit", "by_hash", "hash_of", "extra_names")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.by_hash: dict[int, int] = {}  # engine hash -> node
        self.hash_of: dict[int, int] = {}  # node -> its first engine hash (every held node has one)
        self.extra_names: dict[int, list[int]] = {}  # node -> further engine hashes (rare)


class PythonKvIndexer(KvIndexerBase):
    """Radix index of cached blocks per worker key. Not thread-safe: one owner applies events and
    answers queries (the router's event loop)."""

    implementation = "python"

    def __init__(self) -> None:
        self._mask: dict[int, int] = {}  # node -> bitmask of holders; a node exists iff it is here
        self._parent: dict[int, int] = {}  # node -> parent node (_ROOT for first blocks)
        self._key: dict[int, int] = {}  # node -> its block's local tokens hash (for dumps)
        self._first_child: dict[int, int] = {}  # node or _ROOT -> one of its children
        self._next: dict[int, int] = {}  # node -> next sibling
        self._prev: dict[int, int] = {}  # node -> previous sibling
        self._holders: dict[WorkerKey, _Holder] = {}
        self._sizes: dict[WorkerKey, int] = {}  # blocks held, per worker key
        self._key_of_bit: dict[int, WorkerKey] = {}
        self._free_bits: list[int] = []
        self._next_bit_index = 0
        self._total = 0  # blocks held, summed over worker keys
        self.tiers = LowerTiers(self.device_node_of)

    # ------------------------------------------------------------------------------------------
    # Introspection.

    def workers(self) -> list[WorkerKey]:
        """Worker keys the index holds state for."""
        return list(self._holders)

    @property
    def total_blocks(self) -> int:
        """Blocks held, summed over worker keys (a block held by two workers counts twice)."""
        return self._total

    def num_nodes(self) -> int:
        """Distinct blocks in the tree."""
        return len(self._mask)

    def holds(self, worker: WorkerKey, block_hash: int) -> bool:
        """Whether ``worker`` holds a block it named ``block_hash``."""
        holder = self._holders.get(worker)
        return holder is not None and block_hash in holder.by_hash

    def device_node_of(self, worker: WorkerKey, block_hash: int) -> int | None:
        holder = self._holders.get(worker)
        return None if holder is None else holder.by_hash.get(block_hash)

    def check_invariants(self) -> None:
        """Asserts the structure is consistent (tests and debugging; walks everything)."""
        self.tiers.check_invariants()
        seen = set()
        stack = [_ROOT]
        while stack:
            node = stack.pop()
            prev = None
            c = self._first_child.get(node)
            while c is not None:
                assert c not in seen, "node linked twice"
                seen.add(c)
                assert self._parent[c] == node and self._prev.get(c) == prev
                mask = self._mask[c]
                assert mask, "an unheld node is still linked"
                if node != _ROOT:
                    assert mask & ~self._mask[node] == 0, "a child held where its parent is not"
                stack.append(c)
                prev = c
                c = self._next.get(c)
        assert seen == set(self._mask) == set(self._parent) == set(self._key)
        assert set(self._next) <= seen and set(self._prev) <= seen and set(self._first_child) <= seen | {_ROOT}
        for worker, holder in self._holders.items():
            held = {s for s in self._mask if self._mask[s] & holder.bit}
            assert set(holder.hash_of) == held and self._sizes[worker] == len(held)
            assert set(holder.by_hash.values()) == held
        assert self._total == sum(self._sizes.values())

    # ------------------------------------------------------------------------------------------
    # Queries.

    def find_matches(self, local_hashes: Iterable[int]) -> OverlapScores:
        """Per worker key, how many leading blocks of the prompt (its local hashes) it holds.

        Walks block by block, hashing the chain on the way: the hashes cost more than the
        lookups, and the walk stops hashing at the first block nobody holds.
        """
        if self.tiers.blocks:  # lower tiers need the whole chain: hash it first, then gallop
            return self._match(compute_sequence_hashes(list(local_hashes)))
        scores: dict[WorkerKey, int] = {}
        mask_get = self._mask.get
        it = iter(local_hashes)
        s = next(it, None)
        prev = 0 if s is None else mask_get(s, 0)  # block 0's sequence hash is its local hash
        depth = 0
        if prev:
            key_of_bit = self._key_of_bit
            xxh3 = _xxh3
            pack = _pack_pair
            seed = KV_HASH_SEED
            depth = 1
            for h in it:
                s = xxh3(pack(s, h), seed)
                mask = mask_get(s)
                if mask is None:
                    break
                if mask != prev:
                    dropped = prev & ~mask  # masks only shrink along a prompt
                    while dropped:
                        low = dropped & -dropped
                        scores[key_of_bit[low]] = depth
                        dropped ^= low
                    prev = mask
                depth += 1
            while prev:
                low = prev & -prev
                scores[key_of_bit[low]] = depth
                prev ^= low
        return OverlapScores(scores, self._sizes.copy())

    def find_matches_sequence(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """``find_matches`` for a prompt whose chained sequence hashes are already computed (the
        router computes them for every request), galloping rather than walking."""
        return self._match(seq_hashes)

    def _match(self, seqs: Sequence[int]) -> OverlapScores:
        """Scores by galloping instead of a block-by-block walk.

        Along a prompt the holder masks only shrink (held sets are prefix-closed), so equal
        masks at two depths mean no change in between. From the last change the search probes
        1, 2, 4, ... blocks ahead while the mask stays equal and halves the step when it does
        not, finding each depth where workers drop out in O(log gap) lookups: a 128-block
        prompt held by one worker costs about a dozen lookups, not 128. That matters because
        each lookup in a million-entry dict is a few cache misses.
        """
        scores: dict[WorkerKey, int] = {}
        n = len(seqs)
        mask_get = self._mask.get
        mask = mask_get(seqs[0], 0) if n else 0
        if mask:
            key_of_bit = self._key_of_bit
            i = 0  # every worker in `mask` holds seqs[: i + 1]
            step = 1
            last = n - 1
            while i < last:
                j = i + step
                if j > last:
                    j = last
                    step = j - i
                probe = mask_get(seqs[j], 0)
                if probe == mask:
                    i = j
                    step <<= 1
                elif step > 1:
                    step >>= 1
                else:  # the mask changes between i and j = i + 1: those workers hold j blocks
                    dropped = mask & ~probe
                    while dropped:
                        low = dropped & -dropped
                        scores[key_of_bit[low]] = j
                        dropped ^= low
                    mask = probe
                    i = j
                    if not mask:
                        break
            while mask:
                low = mask & -mask
                scores[key_of_bit[low]] = n
                mask ^= low
        result = OverlapScores(scores, self._sizes.copy())
        if self.tiers.blocks:
            result.lower = self.tiers.continuation(seqs, scores)
        return result

    # ------------------------------------------------------------------------------------------
    # Events.

    def store(self, worker: WorkerKey, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> str:
        """``KvStored``: the worker now holds ``blocks``, a chain under ``parent_hash``.

        The hot path of event application: the chain's sequence hashes are computed in one tight
        pass over the event's blocks, then ``_store`` (shared with ``store_chain``) links them in.
        """
        holder = self._holders.get(worker) or self._register(worker)
        if parent_hash is None:
            parent = _ROOT
        else:
            found = holder.by_hash.get(parent_hash)
            if found is None:
                logger.debug("kv stored parent missing worker=%s parent_hash=%d", worker, parent_hash)
                return PARENT_MISSING
            parent = found
        xxh3 = _xxh3
        pack = _pack_pair
        seed = KV_HASH_SEED
        keys = [blk.tokens_hash for blk in blocks]
        seqs = []
        s = parent
        for key in keys:
            s = key if s == _ROOT else xxh3(pack(s, key), seed)  # the node is its prefix
            seqs.append(s)
        self._store(worker, holder, parent, [blk.block_hash for blk in blocks], keys, seqs)
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
        holder = self._holders.get(worker) or self._register(worker)
        self._store(worker, holder, _ROOT, seq_hashes if block_hashes is None else block_hashes, tokens_hashes, seq_hashes)

    def _store(
        self,
        worker: WorkerKey,
        holder: _Holder,
        parent: int,
        exts: Sequence[int],
        keys: Sequence[int],
        seqs: Sequence[int],
    ) -> None:
        """Links a chain whose sequence hashes are computed into the tree under ``parent``: the
        one loop both ``store`` and ``store_chain`` run (a per-block call would cost more)."""
        bit = holder.bit
        by_hash = holder.by_hash
        hash_of = holder.hash_of
        name_block = by_hash.setdefault
        masks = self._mask
        mask_get = masks.get
        parents = self._parent
        key_of = self._key
        first_child = self._first_child
        first_get = first_child.get
        nxt = self._next
        prv = self._prev
        added = 0
        for ext, key, s in zip(exts, keys, seqs, strict=True):
            old = name_block(ext, s)
            if old != s:
                added = self._rename(worker, holder, ext, old, s, parent, added)
                if added < 0:
                    break
            mask = mask_get(s)
            if mask is None:
                masks[s] = bit
                parents[s] = parent
                key_of[s] = key
                head = first_get(parent)
                if head is not None:
                    nxt[s] = head
                    prv[head] = s
                first_child[parent] = s
                hash_of[s] = ext
                added += 1
            elif not mask & bit:
                masks[s] = mask | bit
                hash_of[s] = ext
                added += 1
            elif hash_of[s] != ext:
                self._extra_name(holder, s, ext)
            parent = s
        if added > 0:
            self._add_size(worker, added)

    def _rename(self, worker: WorkerKey, holder: _Holder, ext: int, old: int, s: int, parent: int, added: int) -> int:
        """The hash ``ext`` already names block ``old``, not ``s``: a collision. Drops the old
        block (keeping counts exact) and names ``s``. Returns the pending added count (0), or -1
        when the old block was an ancestor of the chain being stored, which must then stop."""
        logger.warning("kv block hash reused for another block worker=%s hash=%d", worker, ext)
        if added:
            self._add_size(worker, added)
        self._drop(worker, holder, old)
        if parent != _ROOT and not self._mask.get(parent, 0) & holder.bit:
            return -1
        holder.by_hash[ext] = s
        return 0

    @staticmethod
    def _extra_name(holder: _Holder, s: int, ext: int) -> None:
        """A second engine hash for a block the worker already holds."""
        names = holder.extra_names.setdefault(s, [])
        if ext not in names:
            names.append(ext)

    def remove(self, worker: WorkerKey, block_hashes: Iterable[int]) -> int:
        """``KvRemoved``: the worker dropped these blocks (and so their descendants). Returns the
        number of blocks it no longer holds."""
        holder = self._holders.get(worker)
        if holder is None:
            return 0
        by_hash = holder.by_hash
        hash_of = holder.hash_of
        extra_names = holder.extra_names
        bit = holder.bit
        clear = ~bit
        masks = self._mask
        key_of = self._key
        parents = self._parent
        first_child = self._first_child
        first_get = first_child.get
        nxt = self._next
        prv = self._prev
        nxt_get = nxt.get
        nxt_pop = nxt.pop
        prv_pop = prv.pop
        before = self._sizes[worker]
        removed = 0
        for ext in block_hashes:
            s = by_hash.get(ext)
            if s is None:
                continue
            c = first_get(s)
            while c is not None and not masks[c] & bit:  # children only other workers hold
                c = nxt_get(c)
            if c is not None or extra_names:
                self._add_size(worker, -removed)
                removed = 0
                self._drop(worker, holder, s)  # held descendants or several names: general case
                continue
            del by_hash[hash_of.pop(s)]
            removed += 1
            mask = masks[s] & clear
            if mask:
                masks[s] = mask
                continue
            # Nobody holds it any more: unlink the leaf (inlined _delete_leaf, the hot case).
            del masks[s]
            del key_of[s]
            parent = parents.pop(s)
            after = nxt_pop(s, None)
            before_sib = prv_pop(s, None)
            if before_sib is None:
                if after is None:
                    del first_child[parent]
                else:
                    first_child[parent] = after
                    del prv[after]
            elif after is None:
                del nxt[before_sib]
            else:
                nxt[before_sib] = after
                prv[after] = before_sib
        if removed:
            self._add_size(worker, -removed)
        return before - self._sizes[worker]

    def clear_worker(self, worker: WorkerKey) -> None:
        """``KvCleared``: the worker holds nothing (its key stays registered)."""
        holder = self._holders.get(worker)
        if holder is None:
            return
        clear = ~holder.bit
        masks = self._mask
        dead: list[int] = []
        for s in holder.hash_of:
            mask = masks[s] & clear
            if mask:
                masks[s] = mask
            else:
                dead.append(s)
        self._delete_nodes(dead)
        holder.by_hash.clear()
        holder.hash_of.clear()
        holder.extra_names.clear()
        self._add_size(worker, -self._sizes[worker])

    def remove_worker_key(self, worker: WorkerKey) -> None:
        if worker not in self._holders:
            return
        self.clear_worker(worker)
        holder = self._holders.pop(worker)
        del self._sizes[worker]
        del self._key_of_bit[holder.bit]
        self._free_bits.append(holder.bit)

    # ------------------------------------------------------------------------------------------
    # Snapshots.

    def dump(self, worker: WorkerKey) -> list[KvStored]:
        """The worker's blocks as ``KvStored`` events, parents before children, such that
        applying them to an empty index rebuilds the same held blocks and the same names."""
        holder = self._holders.get(worker)
        if holder is None:
            return []
        bit = holder.bit
        name = holder.hash_of
        parents = self._parent
        key_of = self._key
        out: list[KvStored] = []
        chain: list[StoredBlock] = []
        chain_parent: int | None = None
        last: int | None = None
        stack = self._held_children(_ROOT, bit)
        while stack:  # depth-first, so a chain continues while we descend
            s = stack.pop()
            parent = parents[s]
            if parent != last:
                if chain:
                    out.append(KvStored(parent_hash=chain_parent, blocks=chain))
                chain = []
                chain_parent = None if parent == _ROOT else name[parent]
            chain.append(StoredBlock(name[s], key_of[s]))
            last = s
            stack.extend(self._held_children(s, bit))
        if chain:
            out.append(KvStored(parent_hash=chain_parent, blocks=chain))
        for s, names in holder.extra_names.items():
            parent = parents[s]
            parent_hash = None if parent == _ROOT else name[parent]
            out.extend(KvStored(parent_hash=parent_hash, blocks=[StoredBlock(ext, key_of[s])]) for ext in names)
        return out

    # ------------------------------------------------------------------------------------------
    # Internals.

    def _register(self, worker: WorkerKey) -> _Holder:
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit = 1 << self._next_bit_index
            self._next_bit_index += 1
        holder = self._holders[worker] = _Holder(bit)
        self._sizes[worker] = 0
        self._key_of_bit[bit] = worker
        return holder

    def _add_size(self, worker: WorkerKey, n: int) -> None:
        self._sizes[worker] += n
        self._total += n

    def _held_children(self, node: int, bit: int) -> list[int]:
        masks = self._mask
        nxt = self._next.get
        out = []
        c = self._first_child.get(node)
        while c is not None:
            if masks[c] & bit:
                out.append(c)
            c = nxt(c)
        return out

    def _drop(self, worker: WorkerKey, holder: _Holder, top: int) -> None:
        """Removes ``top`` and the holder's blocks below it, with all their names."""
        bit = holder.bit
        clear = ~bit
        by_hash = holder.by_hash
        hash_of = holder.hash_of
        extra_names = holder.extra_names
        masks = self._mask
        subtree = [top]
        i = 0
        while i < len(subtree):  # breadth-first: parents before children
            subtree.extend(self._held_children(subtree[i], bit))
            i += 1
        dead: list[int] = []
        for s in subtree:
            del by_hash[hash_of.pop(s)]
            if extra_names:
                for ext in extra_names.pop(s, ()):
                    del by_hash[ext]
            mask = masks[s] & clear
            if mask:
                masks[s] = mask
            else:
                dead.append(s)
        self._delete_nodes(dead)
        self._add_size(worker, -len(subtree))

    def _delete_leaf(self, s: int) -> None:
        """Unlinks a childless node nobody holds."""
        del self._mask[s]
        del self._key[s]
        parent = self._parent.pop(s)
        after = self._next.pop(s, None)
        before = self._prev.pop(s, None)
        if before is None:  # it was its parent's first child
            if after is None:
                del self._first_child[parent]
            else:
                self._first_child[parent] = after
                del self._prev[after]
        else:
            if after is None:
                del self._next[before]
            else:
                self._next[before] = after
                self._prev[after] = before

    def _delete_nodes(self, dead: list[int]) -> None:
        """Unlinks nodes nobody holds. ``dead`` is closed under descendants (a node nobody holds
        has no held descendants), so only the tops are unlinked from surviving parents."""
        if not dead:
            return
        dead_set = set(dead)
        parents = self._parent
        for s in dead:
            if parents[s] not in dead_set:
                self._first_child.pop(s, None)  # its children are all dead too
                self._delete_leaf(s)
        for s in dead:
            if s in self._mask:
                del self._mask[s]
                del self._key[s]
                del parents[s]
                self._first_child.pop(s, None)
                self._next.pop(s, None)
                self._prev.pop(s, None)
