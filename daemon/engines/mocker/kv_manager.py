"""Per-request KV accounting on top of the block pool: prefix lookup, slot allocation, freeing.

Modelled on vLLM's ``KVCacheManager``. "Does not fit right now" is a normal answer (``None`` from
``allocate_slots``), not an exception: the scheduler reacts by preempting or by waiting. Full
blocks are offered to the prefix cache as soon as they are scheduled (as vLLM v1 does), so a
request admitted later in the same step already hits them.

Pinned prefixes (``MockRequest.pin``, from ``cache_control``): once a request's first
``pin.num_tokens // block_size`` blocks are cached, the ``PinTable`` (pins.py) records them and
each newly pinned block gets one more reference, held by the pin: the allocator never evicts a
referenced block, so a pinned prefix survives any eviction storm until its TTL runs out; then the
reference is dropped and the block is an ordinary cached free block again. A cache hit on pinned
blocks refreshes them. The lower tiers ask the same table before pushing a hash out.

Pins are a preference, not a reservation: when the blocks held only by pins leave too little of
the cache for a request to fit even once every running request has finished, the pins soonest to
expire give way (``_yield_pins``) instead of leaving that request waiting for their TTL (minutes).
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamod.daemon.engines.mocker.block_pool import BlockPool, KVBlock
from dynamod.daemon.engines.mocker.pins import DEFAULT_MAX_PINNED_FRACTION, Clock, PinTable
from dynamod.daemon.engines.mocker.request import MockRequest
from dynamod.daemon.engines.mocker.tiers import OnboardPlan, TieredKvCache
from dynamod.shared.protocol.kv_events import MEDIUM_GPU, KvCleared, KvEvent

_NO_BLOCKS: list[KVBlock] = []


class KVCacheManager:
    """Allocates blocks to requests of one data-parallel rank."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True,
        max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
        clock: Clock | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.tiers: TieredKvCache | None = None
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        max_pinned = int(max_pinned_fraction * num_blocks) if enable_caching else 0
        self.pins = PinTable(max_pinned) if clock is None else PinTable(max_pinned, clock)

    def attach_tiers(self, tiers: TieredKvCache) -> None:
        """Puts host/disk tiers behind the device pool: its evictions go to them, and prefixes
        continuing there are onboarded (``find_offloaded``/``onboard``)."""
        if not self.enable_caching:
            raise ValueError("KV tiers need prefix caching")
        self.tiers = tiers
        self.block_pool.on_evict = tiers.on_evict
        tiers.set_pinned(self.pins.is_pinned)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.get_num_used_blocks()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: MockRequest) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``request`` as (blocks, tokens); nothing is referenced yet.

        At most ``num_tokens - 1`` tokens can hit: the last one must be computed to sample from.
        """
        if not self.enable_caching:
            return _NO_BLOCKS, 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return _NO_BLOCKS, 0
        request.ensure_block_hashes(max_blocks, bs)
        lookup = self.block_pool.cached_block_hash_to_block.get
        hashes = request.block_hashes
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def find_offloaded(self, request: MockRequest, num_hit_blocks: int) -> OnboardPlan | None:
        """The blocks after the ``num_hit_blocks`` device hits that the lower tiers hold (as
        ``get_computed_blocks``, never the block of the last prompt token)."""
        tiers = self.tiers
        if tiers is None:
            return None
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if num_hit_blocks >= max_blocks:
            return None
        return tiers.find(request.block_hashes, num_hit_blocks, max_blocks)

    def onboard(self, request: MockRequest, plan: OnboardPlan) -> float:
        """Fills the request's freshly allocated blocks ``plan.start ..`` from the lower tiers
        (after ``allocate_slots`` made room and cached them), disk blocks from the bytes read for
        the request if it waited for them; returns the time it takes (ms)."""
        assert self.tiers is not None
        blocks = request.blocks[plan.start:plan.start + len(plan.entries)]
        return self.tiers.onboard(plan, blocks, request.staged_kv)

    def allocate_slots(
        self,
        request: MockRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = _NO_BLOCKS,
        num_new_computed_tokens: int = 0,
        watermark_blocks: int = 0,
        delay_caching: bool = False,
    ) -> list[KVBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens of ``request``; None if they do not fit.

        ::

            | computed (held) | new computed (cache hits) | new tokens (this step) | unallocated |
                                                           ^ blocks allocated here

        ``watermark_blocks`` free blocks must remain afterwards (the scheduler asks for it when
        admitting a request while others run, so running requests keep room to grow).
        ``delay_caching`` keeps the new blocks out of the prefix cache (their KV is still to
        arrive from another worker, as vLLM's ``delay_cache_blocks``): ``cache_blocks`` later.
        """
        bs = self.block_size
        pool = self.block_pool
        if self.pins:
            self.expire_pins()
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = -(-num_tokens // bs) - len(request.blocks) - len(new_computed_blocks)
        free = pool.free_block_queue.num_free_blocks
        if new_computed_blocks:
            # Hits that sit in the free list leave it when touched.
            free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > free - watermark_blocks and num_new_blocks > 0:
            if not self.pins or not self._yield_pins(request, new_computed_blocks, num_new_blocks + watermark_blocks):
                return None
            free = pool.free_block_queue.num_free_blocks - sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks > free - watermark_blocks:
                return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            request.blocks.extend(new_computed_blocks)
            request.num_cached_blocks = len(request.blocks)
            if self.pins:
                self.pins.refresh(b.block_hash for b in new_computed_blocks)  # type: ignore[misc]
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            request.blocks.extend(new_blocks)
        else:
            new_blocks = _NO_BLOCKS
        if self.enable_caching and not delay_caching and num_tokens >= (request.num_cached_blocks + 1) * bs:
            self._cache_full_blocks(request, num_tokens // bs)
        if request.pin is not None:
            hit = request.num_cached_tokens if request.num_cached_tokens >= 0 else num_new_computed_tokens
            self._apply_pin(request, hit)
        return new_blocks

    def cache_blocks(self, request: MockRequest, num_tokens: int) -> None:
        """Offers the full blocks of the first ``num_tokens`` tokens to the prefix cache (after a
        delayed allocation, once their KV is in place)."""
        num_full = num_tokens // self.block_size
        if self.enable_caching and num_full > request.num_cached_blocks:
            self._cache_full_blocks(request, num_full)
        if request.pin is not None:
            self._apply_pin(request, max(request.num_cached_tokens, 0))

    # ---- pinned prefixes -------------------------------------------------------------------------

    def _apply_pin(self, request: MockRequest, hit_tokens: int) -> None:
        """Pins the request's prefix once its blocks are all in the prefix cache (a prompt still
        being scheduled in chunks waits for its later chunks). ``hit_tokens``: the prompt's
        prefix-cache hit, which a newly pinned block does not count as created."""
        pin = request.pin
        assert pin is not None
        bs = self.block_size
        num_blocks = min(pin.num_tokens, request.num_prompt_tokens) // bs
        if not self.enable_caching or num_blocks <= 0:
            request.pin = None
            return
        if request.num_cached_blocks < num_blocks:
            return  # not all scheduled yet
        request.pin = None
        prefix = request.block_hashes[:num_blocks]
        cache = self.block_pool.cached_block_hash_to_block
        # A hash another block held first is cached under that block (``cache_full_blocks``).
        outcome = self.pins.pin([h for h in prefix if h in cache], pin.ttl_s)
        if outcome.refused:
            request.pin_refused = True
            return
        if outcome.new:
            self.block_pool.touch([cache[h] for h in outcome.new])  # the pin's own reference
            index = {h: i for i, h in enumerate(prefix)}
            hit_blocks = hit_tokens // bs
            request.num_pinned_tokens = bs * sum(1 for h in outcome.new if index[h] >= hit_blocks)

    def _yield_pins(self, request: MockRequest, hits: Sequence[KVBlock], needed: int) -> bool:
        """Unpins, soonest expiry first, the idle pinned blocks that stand between ``request``
        and the ``needed`` new blocks it could otherwise get once every other request has
        finished (the blocks it holds and the cache hits it is taking count as its own). True
        when some pin gave way; a request that only has to wait for running ones leaves the pins
        alone."""
        pool = self.block_pool
        if needed <= pool.num_blocks - len(self.pins) - len(request.blocks) - len(hits):
            return False  # fits beside every pin even if all were idle: no scan (the common case)
        cache = pool.cached_block_hash_to_block
        taken = {id(b) for b in hits}
        idle = [h for h in self.pins.by_expiry()
                if (b := cache.get(h)) is not None and b.ref_cnt == 1 and id(b) not in taken]
        reachable = pool.num_blocks - len(idle) - len(request.blocks) - len(hits)
        if needed <= reachable or not idle:
            return False
        give = idle[:needed - reachable]
        self.pins.release(give)
        pool.free_blocks([cache[h] for h in give])
        return True

    def expire_pins(self) -> int:
        """Drops the references of pins whose TTL ran out; returns how many blocks were unpinned."""
        expired = self.pins.expired()
        if not expired:
            return 0
        cache = self.block_pool.cached_block_hash_to_block
        self.block_pool.free_blocks([cache[h] for h in expired if h in cache])
        return len(expired)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pins)

    @property
    def num_idle_pinned_blocks(self) -> int:
        """Pinned blocks no request holds (their only reference is the pin's); O(pins)."""
        if not self.pins:
            return 0
        cache = self.block_pool.cached_block_hash_to_block
        return sum(1 for h in self.pins.hashes() if (b := cache.get(h)) is not None and b.ref_cnt == 1)

    def _drop_pins(self) -> None:
        """Releases every pin's reference (before the device cache forgets its hashes)."""
        cache = self.block_pool.cached_block_hash_to_block
        blocks = [cache[h] for h in self.pins.clear() if h in cache]
        if blocks:
            self.block_pool.free_blocks(blocks)

    def _cache_full_blocks(self, request: MockRequest, num_full_blocks: int) -> None:
        """Offers blocks [num_cached_blocks, num_full_blocks) to the prefix cache and queues one
        ``KvStored`` per run of blocks that were new to it."""
        request.ensure_block_hashes(num_full_blocks, self.block_size)
        self.block_pool.cache_full_blocks(
            request.blocks, request.block_hashes, request.local_hashes, request.num_cached_blocks, num_full_blocks,
            request.lora_name,
        )
        request.num_cached_blocks = num_full_blocks

    def free(self, request: MockRequest) -> None:
        """Releases the request's blocks, tail first, so its last blocks are evicted first."""
        if request.blocks:
            self.block_pool.free_blocks(reversed(request.blocks))
            request.blocks = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self, medium: str | None = None) -> int:
        """Clears one tier (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_DISK``) or every tier (None);
        returns how many blocks were dropped and queues one ``KvCleared`` naming what was cleared."""
        tiers = self.tiers
        pool = self.block_pool
        if medium in (None, MEDIUM_GPU) and self.pins:
            self._drop_pins()
        if tiers is None:  # the device cache is every tier there is
            return pool.reset_prefix_cache(None) if medium in (None, MEDIUM_GPU) else 0
        dropped = 0
        if medium is None:
            dropped += tiers.clear(None)
            pool.queue_events(tiers.take_events())
            dropped += pool.reset_prefix_cache(None)
        elif medium == MEDIUM_GPU:
            tiers.flush()
            pool.queue_events(tiers.take_events())
            dropped += pool.reset_prefix_cache(MEDIUM_GPU)
        else:
            dropped += tiers.clear(medium)
            pool.queue_events(tiers.take_events())
            pool.queue_events([KvCleared(medium=medium)])
        return dropped

    def take_events(self) -> list[KvEvent]:
        tiers = self.tiers
        if tiers is not None:
            tiers.flush()
            events = tiers.take_events()
            if events:
                self.block_pool.queue_events(events)
        return self.block_pool.take_events()
