"""Active sequences: load per worker from routing, prefill done, free, and stale expiry."""

from __future__ import annotations

from dynamod.daemon.router.core.active_sequences import ActiveSequences

BS = 16
W = (7, 0)


def test_lifecycle_counts_blocks_and_prefill_tokens(clock):
    active = ActiveSequences(BS, clock=clock)
    active.add("r1", W, [1, 2, 3], 3 * BS + 5, prefill_tokens=3 * BS + 5)
    assert active.active_blocks(W) == 4  # three full blocks and the partial tail
    assert active.active_prefill_tokens(W) == 53
    assert active.mark_prefill_done("r1")
    assert not active.mark_prefill_done("r1")  # idempotent
    assert active.active_prefill_tokens(W) == 0
    assert active.active_blocks(W) == 4
    assert active.free("r1")
    assert not active.free("r1")
    assert active.active_blocks(W) == 0 and active.load(W) is None


def test_shared_prefix_blocks_count_once(clock):
    active = ActiveSequences(BS, clock=clock)
    active.add("a", W, [1, 2, 3], 3 * BS, 0)
    active.add("b", W, [1, 2, 4, 5], 4 * BS, 0)
    assert active.active_blocks(W) == 5
    assert active.new_blocks(W, [1, 2, 3, 9], 4 * BS + 1) == 2  # 1, 2, 3 shared; 9 and the tail new
    active.free("a")
    assert active.active_blocks(W) == 4
    assert active.new_blocks(W, [1, 2, 3], 3 * BS) == 1


def test_free_before_first_token_releases_prefill(clock):
    active = ActiveSequences(BS, clock=clock)
    active.add("a", W, [1], BS, BS)
    active.add("b", W, [2], BS, BS)
    active.free("a")
    assert active.active_prefill_tokens(W) == BS


def test_stale_requests_expire_after_ttl(clock):
    active = ActiveSequences(BS, ttl_s=60, clock=clock)
    active.add("old", W, [1], BS, BS)
    clock.advance(30)
    active.add("young", W, [2], BS, BS)
    clock.advance(31)
    assert active.expire() == ["old"]
    assert "old" not in active and "young" in active
    assert active.active_blocks(W) == 1


def test_readding_a_request_replaces_it(clock):
    active = ActiveSequences(BS, clock=clock)
    active.add("a", W, [1], BS, BS)
    active.add("a", (8, 0), [1], BS, BS)
    assert active.load(W) is None and active.worker_of("a") == (8, 0)


def test_workers_sharing_a_first_block_follow_adds_frees_and_expiry(clock):
    """The scheduler asks only these workers for shared active blocks, so the set must track
    every way a request stops counting."""
    active = ActiveSequences(BS, ttl_s=60, clock=clock)
    other = (8, 1)
    active.add("a", W, [1, 2, 3], 3 * BS, 0)
    active.add("b", W, [1, 2, 4], 3 * BS, 0)
    active.add("c", other, [1, 5], 2 * BS, 0)
    active.add("d", other, [9], BS, 0)
    assert active.workers_sharing_first_block(1) == {W: 2, other: 1}
    assert active.workers_sharing_first_block(2) == {}  # not a first block
    active.free("a")
    assert active.workers_sharing_first_block(1) == {W: 1, other: 1}
    active.remove_worker(8)
    assert active.workers_sharing_first_block(1) == {W: 1}
    assert active.workers_sharing_first_block(9) == {}
    clock.advance(61)
    active.add("e", W, [], 0, 0)  # adding expires the stale ones; an empty prompt shares nothing
    assert active.workers_sharing_first_block(1) == {}
    assert "b" not in active
