"""Block pool: free-list order, refcounts, lazy eviction with events, and property-based invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.engines.mocker.block_pool import BlockPool, FreeBlockQueue, KVBlock
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, StoredBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_operations_keep_order_and_count():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]

    queue.remove(blocks[2])  # O(1) removal from the middle (a cache hit)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4, 2]
    assert queue.num_free_blocks == 5


def test_new_blocks_come_from_the_head_with_ref_one():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 3
    assert pool.get_num_used_blocks() == 3
    assert pool.get_usage() == 0.5


def test_cached_free_blocks_go_to_the_tail_and_uncached_to_the_head():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(a, 101, 11, None, None)
    assert pool.cache_block(b, 102, 12, 101, None)
    pool.free_blocks([c, b, a])  # reverse order, as the KV manager frees
    # c holds nothing reusable: reused first; b and a stay cached behind the never-used blocks.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 4, 5, 1, 0]
    assert pool.get_cached_block(101) is a and pool.get_cached_block(102) is b


def test_eviction_is_lazy_lru_and_emits_removed_events():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 201, 21, None, None)
    pool.cache_block(b, 202, 22, 201, None)
    pool.emit_stored(None, [a, b], None)
    pool.free_blocks([b, a])
    assert pool.take_events() == [
        KvStored(parent_hash=None, blocks=[StoredBlock(201, 21), StoredBlock(202, 22)], lora_name=None)
    ]
    # Free list: 2, 3 (never used), then b, a. Taking 3 evicts only b.
    got = pool.get_new_blocks(3)
    assert ids(got) == [2, 3, 1]
    assert pool.take_events() == [KvRemoved(block_hashes=[202])]
    assert pool.get_cached_block(202) is None and b.block_hash is None
    assert pool.get_cached_block(201) is a
    assert pool.take_events() == []


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 301, 31, None, None)
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2


def test_duplicate_hash_is_not_cached_twice():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 401, 41, None, None)
    assert not pool.cache_block(b, 401, 41, None, None)
    assert b.block_hash is None and pool.get_cached_block(401) is a


def test_reset_prefix_cache_forgets_every_hash_and_emits_cleared():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 501, 51, None, None)
    pool.cache_block(b, 502, 52, 501, None)
    pool.free_blocks([b])  # b free and cached, a still in use
    assert pool.reset_prefix_cache() == 2
    assert pool.take_events() == [KvCleared()]
    assert pool.num_cached_blocks == 0 and a.block_hash is None and b.block_hash is None
    # b no longer holds anything reusable, so it is handed out before the never-used blocks.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3]
    assert pool.get_new_blocks(3) and pool.take_events() == []  # nothing left to evict


def test_iter_cached_blocks_yields_parents_before_children():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(5)
    # Tree: 1 -> 2 -> 3, 2 -> 4, and an orphan 5 whose parent 99 is gone.
    for block, (h, parent) in zip(blocks, [(1, None), (2, 1), (3, 2), (4, 2), (5, 99)], strict=True):
        pool.cache_block(block, h, h + 100, parent, None)
    runs = [[b.block_hash for b in run] for run in pool.iter_cached_blocks()]
    seen: set[int] = set()
    for run in runs:
        parent = pool.get_cached_block(run[0]).parent_hash
        assert parent is None or parent == 99 or parent in seen
        seen.update(run)
    assert sorted(seen) == [1, 2, 3, 4, 5]
    assert [1, 2, 3] in runs


# ---- property: any interleaving of allocate / cache / hit / free keeps the pool consistent ----

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 4)),
        st.tuples(st.just("cache"), st.integers(0, 50), st.integers(0, 7)),
        st.tuples(st.just("hit"), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("reset"),),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, database=None)
@given(ops)
def test_pool_invariants_hold_under_any_operation_sequence(sequence):
    pool = BlockPool(8)
    held: list[KVBlock] = []  # one entry per reference we own
    router_view: set[int] = set()  # what a router rebuilds from the events

    for op in sequence:
        kind = op[0]
        if kind == "alloc" and op[1] <= pool.get_num_free_blocks():
            held.extend(pool.get_new_blocks(op[1]))
        elif kind == "cache" and held:
            block = held[op[1] % len(held)]
            h = 1000 + op[2]
            if block.block_hash is None and pool.cache_block(block, h, h, None, None):
                pool.emit_stored(None, [block], None)
        elif kind == "hit":
            block = pool.get_cached_block(1000 + op[1])
            if block is not None:
                pool.touch([block])
                held.append(block)
        elif kind == "free" and held:
            pool.free_blocks([held.pop(op[1] % len(held))])
        elif kind == "reset":
            pool.reset_prefix_cache()

        for event in pool.take_events():
            if isinstance(event, KvStored):
                router_view.update(b.block_hash for b in event.blocks)
            elif isinstance(event, KvRemoved):
                assert set(event.block_hashes) <= router_view
                router_view.difference_update(event.block_hashes)
            else:
                router_view.clear()

        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == pool.get_num_free_blocks() == len(set(map(id, free)))
        assert all(b.ref_cnt == 0 for b in free)
        for block in pool.blocks:
            assert block.ref_cnt == sum(1 for h in held if h is block)
        assert pool.get_num_free_blocks() + sum(1 for b in pool.blocks if b.ref_cnt > 0) == 8
        for h, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == h
        assert sum(1 for b in pool.blocks if b.block_hash is not None) == pool.num_cached_blocks
        # The events describe the cache exactly.
        assert router_view == set(pool.cached_block_hash_to_block)


def test_batch_free_list_operations_match_one_at_a_time():
    """``popleft_many``/``extend``/``extendleft`` (one splice each) leave the list as the single-block
    operations do, in order and count."""
    one = FreeBlockQueue([KVBlock(i) for i in range(8)])
    many = FreeBlockQueue([KVBlock(i) for i in range(8)])
    taken_one = [one.popleft() for _ in range(5)]
    taken_many = many.popleft_many(5)
    assert ids(taken_one) == ids(taken_many) == [0, 1, 2, 3, 4]
    for block in (taken_one[1], taken_one[3]):
        one.append(block)
    for block in (taken_one[0], taken_one[4]):
        one.appendleft(block)
    many.extend([taken_many[1], taken_many[3]])
    many.extendleft([taken_many[0], taken_many[4]])
    assert ids(one.get_all_free_blocks()) == ids(many.get_all_free_blocks()) == [4, 0, 5, 6, 7, 1, 3]
    assert one.num_free_blocks == many.num_free_blocks == 7
    assert ids(many.popleft_many(7)) == [4, 0, 5, 6, 7, 1, 3] and many.num_free_blocks == 0
    many.extendleft([taken_many[2]])  # into an empty list
    assert ids(many.get_all_free_blocks()) == [2]


def test_cache_full_blocks_is_cache_block_per_block_with_one_event_per_new_run():
    """A run of a request's blocks where one hash is already held elsewhere: the blocks before and
    after it are stored as two runs (each with its parent), the duplicate is not stored at all."""
    one, many = BlockPool(8), BlockPool(8)
    hashes, tokens = [11, 12, 13, 14, 15], [1, 2, 3, 4, 5]
    for pool in (one, many):
        (other,) = pool.get_new_blocks(1)
        pool.cache_block(other, 13, 3, 12, None)  # another request holds block 3's hash
        pool.take_events()
    blocks_one, blocks_many = one.get_new_blocks(5), many.get_new_blocks(5)
    one.cache_block(blocks_one[0], 11, 1, None, "lora")  # 11 was cached by an earlier step
    many.cache_block(blocks_many[0], 11, 1, None, "lora")
    runs: list[list[KVBlock]] = [[]]
    for i in range(1, 5):
        if one.cache_block(blocks_one[i], hashes[i], tokens[i], hashes[i - 1], "lora"):
            runs[-1].append(blocks_one[i])
        else:
            runs.append([])
    for run in runs:
        if run:
            one.emit_stored(run[0].parent_hash, run, "lora")
    many.cache_full_blocks(blocks_many, hashes, tokens, 1, 5, "lora")
    assert one.take_events() == many.take_events() == [
        KvStored(parent_hash=11, blocks=[StoredBlock(12, 2)], lora_name="lora"),
        KvStored(parent_hash=13, blocks=[StoredBlock(14, 4), StoredBlock(15, 5)], lora_name="lora"),
    ]
    for a, b in zip(blocks_one, blocks_many, strict=True):
        assert (a.block_hash, a.tokens_hash, a.parent_hash, a.lora_name) == (b.block_hash, b.tokens_hash,
                                                                              b.parent_hash, b.lora_name)
    assert set(one.cached_block_hash_to_block) == set(many.cached_block_hash_to_block) == {11, 12, 13, 14, 15}
