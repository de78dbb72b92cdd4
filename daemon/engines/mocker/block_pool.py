"""The paged KV cache's memory: blocks, refcounts, the LRU free list and the prefix-cache map.

Modelled on vLLM's ``BlockPool``: the pool owns the mechanism and knows nothing about scheduling.
A block with ``ref_cnt == 0`` sits in the free list; if it still has a hash it also stays in the
hash map, so a later request can revive it (a prefix-cache hit) until the allocator reaches it at
the head of the free list. Eviction is lazy: it happens only when ``get_new_blocks`` hands such a
block out, and that is when ``KvRemoved`` is queued. ``cache_block`` queues ``KvStored`` for blocks
that became cached. Events accumulate in a plain list drained once per step by ``take_events``.

Hashes are the router's (shared/kv/hashing.py): ``block_hash`` is the chained sequence hash (the
engine-side identity, also the hash-map key) and ``tokens_hash`` the block's local hash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from dynamod.shared.protocol.kv_events import KvCleared, KvEvent, KvRemoved, KvStored, StoredBlock


class KVBlock:
    """One KV cache block; also its own node in the intrusive free list (no wrapper objects)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "tokens_hash", "parent_hash", "lora_name", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # sequence hash while the block is in the prefix cache
        self.tokens_hash = 0
        self.parent_hash: int | None = None
        self.lora_name: str | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks through their ``prev_free``/``next_free`` slots.

    Head = least recently freed = next to be allocated (and evicted). Removing a block from the
    middle, needed when a cache hit revives a free block, is O(1).
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block!r} is not in the free list")
        self._unlink(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def popleft_many(self, n: int) -> list[KVBlock]:
        """The ``n`` blocks at the head, unlinked with one splice (a prefill takes hundreds)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} free blocks ({self.num_free_blocks} free)")
        out: list[KVBlock] = []
        append = out.append
        head = self._head
        block = head.next_free
        for _ in range(n):
            append(block)  # type: ignore[arg-type]
            nxt = block.next_free  # type: ignore[union-attr]
            block.prev_free = block.next_free = None  # type: ignore[union-attr]
            block = nxt
        head.next_free = block
        block.prev_free = head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def extend(self, blocks: list[KVBlock]) -> None:
        """``append`` each block in order, with one splice at the tail."""
        if not blocks:
            return
        tail = self._tail
        last = tail.prev_free
        for block in blocks:
            last.next_free = block  # type: ignore[union-attr]
            block.prev_free = last
            last = block
        last.next_free = tail  # type: ignore[union-attr]
        tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def extendleft(self, blocks: list[KVBlock]) -> None:
        """``appendleft`` each block in order (the last one ends at the head), with one splice."""
        if not blocks:
            return
        head = self._head
        first = head.next_free
        for block in blocks:
            block.next_free = first
            first.prev_free = block  # type: ignore[union-attr]
            first = block
        head.next_free = first
        first.prev_free = head  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt  # type: ignore[union-attr]
        nxt.prev_free = prev  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVBlock]:
        """Free blocks from head (next evicted) to tail; for tests and dumps."""
        out = []
        block = self._head.next_free
        while block is not self._tail and block is not None:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """Owns every block of one data-parallel rank."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVBlock] = {}
        self._events: list[KvEvent] = []
        # Called with the cached blocks an allocation evicts, before their hashes are dropped
        # (the lower KV tiers take them: tiers.py). None: evicted blocks are simply forgotten.
        self.on_evict: Callable[[list[KVBlock]], None] | None = None

    # ---- queries -------------------------------------------------------------------------------

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks referenced by at least one request (what decode time and load metrics count)."""
        return self.num_blocks - self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return (self.num_blocks - self.free_block_queue.num_free_blocks) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    # ---- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pops ``num_blocks`` from the LRU head with ref 1, evicting any cached ones."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool ({queue.num_free_blocks} free)")
        out = queue.popleft_many(num_blocks)
        evicted: list[int] | None = None
        cache = self.cached_block_hash_to_block
        on_evict = self.on_evict
        if on_evict is not None:
            leaving = [block for block in out if block.block_hash is not None]
            if leaving:
                on_evict(leaving)
        for block in out:
            block.ref_cnt = 1
            block_hash = block.block_hash
            if block_hash is not None:
                del cache[block_hash]
                if evicted is None:
                    evicted = []
                evicted.append(block_hash)
                block.block_hash = None
                block.parent_hash = None
                block.lora_name = None
        if evicted:
            self._events.append(KvRemoved(block_hashes=evicted))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on cache-hit blocks, pulling free ones out of the free list."""
        queue = self.free_block_queue
        revived = 0
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                if prev is None or nxt is None:
                    raise RuntimeError(f"{block!r} is not in the free list")
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                revived += 1
            block.ref_cnt += 1
        queue.num_free_blocks -= revived

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drops one reference each; blocks reaching zero become free in the given order.

        Cached blocks go to the tail (evicted last among the free); blocks without a hash hold
        nothing reusable, so they go to the head and are reused before any cached block is evicted.
        """
        reusable: list[KVBlock] = []  # to the tail, in order
        empty: list[KVBlock] = []  # to the head, each ahead of the previous
        for block in ordered_blocks:
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if ref == 0:
                (empty if block.block_hash is None else reusable).append(block)
            elif ref < 0:
                raise RuntimeError(f"{block!r} freed more often than referenced")
        queue = self.free_block_queue
        queue.extend(reusable)
        queue.extendleft(empty)

    # ---- prefix cache --------------------------------------------------------------------------

    def cache_block(
        self, block: KVBlock, block_hash: int, tokens_hash: int, parent_hash: int | None, lora_name: str | None
    ) -> bool:
        """Registers a full block under its sequence hash. False (and no event) when another block
        already holds that hash: the router knows the hash already, and one owner per hash keeps
        later removals unambiguous."""
        cache = self.cached_block_hash_to_block
        if block_hash in cache:
            return False
        if block.block_hash is not None:
            raise RuntimeError(f"{block!r} is already cached")
        block.block_hash = block_hash
        block.tokens_hash = tokens_hash
        block.parent_hash = parent_hash
        block.lora_name = lora_name
        cache[block_hash] = block
        return True

    def cache_full_blocks(
        self,
        blocks: list[KVBlock],
        block_hashes: list[int],
        tokens_hashes: list[int],
        start: int,
        end: int,
        lora_name: str | None,
    ) -> None:
        """``cache_block`` for ``blocks[start:end]`` of one request (block i's parent is
        ``block_hashes[i - 1]``), queueing one ``KvStored`` per run of blocks new to the cache:
        the same cache and the same events as block by block, without a call per block."""
        cache = self.cached_block_hash_to_block
        run_start = -1  # first block of the current run of newly cached blocks
        i = start
        for block, block_hash, tokens_hash in zip(
            blocks[start:end], block_hashes[start:end], tokens_hashes[start:end], strict=True
        ):
            if block_hash in cache:  # another block holds it: the router knows it already
                if run_start >= 0:
                    self._stored_run(block_hashes, tokens_hashes, run_start, i, lora_name)
                    run_start = -1
            else:
                if block.block_hash is not None:
                    raise RuntimeError(f"{block!r} is already cached")
                block.block_hash = block_hash
                block.tokens_hash = tokens_hash
                block.parent_hash = block_hashes[i - 1] if i else None
                block.lora_name = lora_name
                cache[block_hash] = block
                if run_start < 0:
                    run_start = i
            i += 1
        if run_start >= 0:
            self._stored_run(block_hashes, tokens_hashes, run_start, end, lora_name)

    def _stored_run(self, block_hashes: list[int], tokens_hashes: list[int], lo: int, hi: int,
                    lora_name: str | None) -> None:
        self._events.append(
            KvStored(
                parent_hash=block_hashes[lo - 1] if lo else None,
                blocks=list(map(StoredBlock, block_hashes[lo:hi], tokens_hashes[lo:hi])),
                lora_name=lora_name,
            )
        )

    def emit_stored(self, parent_hash: int | None, blocks: list[KVBlock], lora_name: str | None) -> None:
        """Queues one ``KvStored`` for a run of consecutive newly cached blocks of one request."""
        self._events.append(
            KvStored(
                parent_hash=parent_hash,
                blocks=[StoredBlock(b.block_hash, b.tokens_hash) for b in blocks],  # type: ignore[arg-type]
                lora_name=lora_name,
            )
        )

    def reset_prefix_cache(self, medium: str | None = None) -> int:
        """Forgets every cached hash (blocks in use keep their contents but are no longer
        shareable), queues ``KvCleared(medium)`` and returns how many blocks were dropped from the
        cache. ``medium`` None says every tier of the worker was emptied (no lower tiers, or all
        of them cleared too); ``MEDIUM_GPU`` only this device cache."""
        cache = self.cached_block_hash_to_block
        dropped = len(cache)
        queue = self.free_block_queue
        for block in cache.values():
            block.block_hash = None
            block.parent_hash = None
            block.lora_name = None
            if block.ref_cnt == 0:
                # Nothing reusable any more: move it ahead of the cached free blocks.
                queue.remove(block)
                queue.appendleft(block)
        cache.clear()
        self._events.append(KvCleared(medium=medium))
        return dropped

    def queue_events(self, events: list[KvEvent]) -> None:
        """Adds events produced beside the pool (the lower tiers'), after the pool's own."""
        self._events.extend(events)

    def take_events(self) -> list[KvEvent]:
        """Hands over the queued events; the caller owns the returned list."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def iter_cached_blocks(self) -> Iterator[list[KVBlock]]:
        """Cached blocks as runs of parent-to-child chains, every parent before its children.

        A block whose parent is no longer cached (its parent was evicted first) starts a run of
        its own, so a reader sees it with its original ``parent_hash``.
        """
        cache = self.cached_block_hash_to_block
        children: dict[int, list[KVBlock]] = {}
        roots: list[KVBlock] = []
        for block in cache.values():
            parent = block.parent_hash
            if parent is not None and parent in cache:
                children.setdefault(parent, []).append(block)
            else:
                roots.append(block)
        stack = list(reversed(roots))
        while stack:
            block = stack.pop()
            run = [block]
            while True:
                kids = children.get(run[-1].block_hash)  # type: ignore[arg-type]
                if not kids:
                    break
                # Continue the run with the first child; the others start runs of their own.
                stack.extend(reversed(kids[1:]))
                run.append(kids[0])
            yield run
