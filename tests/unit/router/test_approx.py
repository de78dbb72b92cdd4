"""Approximate mode: routed prompts count as cached for a TTL; the tree is pruned oldest first."""

from __future__ import annotations

from dynamod.shared.kv.approx import ApproxKvIndexer
from dynamod.shared.kv.hashing import hash_tokens

BS = 4


def _prompt(seed: int, blocks: int) -> tuple[list[int], list[int]]:
    return hash_tokens([seed * 1000 + i for i in range(blocks * BS)], BS)


def test_routed_blocks_expire_after_the_ttl(clock):
    approx = ApproxKvIndexer(ttl_s=120, clock=clock)
    local, seq = _prompt(1, 3)
    approx.record((1, 0), local, seq)
    assert approx.find_matches(local).scores == {(1, 0): 3}
    clock.advance(119.9)
    assert approx.find_matches(local).scores == {(1, 0): 3}
    clock.advance(0.2)
    assert approx.find_matches(local).scores == {}
    assert approx.indexer.total_blocks == 0
    assert approx.tracked_blocks() == 0


def test_routing_again_refreshes_the_ttl_of_the_shared_prefix(clock):
    approx = ApproxKvIndexer(ttl_s=100, clock=clock)
    a_local, a_seq = _prompt(1, 4)
    approx.record((1, 0), a_local, a_seq)
    clock.advance(60)
    # A second prompt sharing the first two blocks refreshes them only.
    b_local = a_local[:2] + _prompt(2, 1)[0]
    b_seq = a_seq[:2] + hash_tokens([1000 + i for i in range(2 * BS)] + [2000 + i for i in range(BS)], BS)[1][2:]
    approx.record((1, 0), b_local, b_seq)
    clock.advance(50)  # 110 s after the first, 50 s after the second
    assert approx.find_matches(a_local).scores == {(1, 0): 2}
    assert approx.find_matches(b_local).scores == {(1, 0): 3}
    clock.advance(51)
    assert approx.find_matches(b_local).scores == {}


def test_ttl_is_per_worker(clock):
    approx = ApproxKvIndexer(ttl_s=10, clock=clock)
    local, seq = _prompt(1, 2)
    approx.record((1, 0), local, seq)
    clock.advance(6)
    approx.record((2, 0), local, seq)
    clock.advance(6)
    assert approx.find_matches(local).scores == {(2, 0): 2}


def test_pruning_drops_the_oldest_blocks_down_to_the_target(clock):
    approx = ApproxKvIndexer(ttl_s=1000, max_tree_size=10, prune_target_ratio=0.6, clock=clock)
    prompts = [_prompt(i, 3) for i in range(3)]
    for i, (local, seq) in enumerate(prompts):  # 9 blocks, under the limit
        approx.record((i % 2, 0), local, seq)
        clock.advance(1)
    assert approx.indexer.total_blocks == 9
    newest = _prompt(9, 2)
    approx.record((1, 0), *newest)  # 11 > 10: prune to at most 6, oldest first
    # A prompt's first block is its oldest entry and takes its (equally old) tail with it, so
    # whole prompts go: 11 - 3 - 3 = 5.
    assert approx.indexer.total_blocks == 5
    assert approx.find_matches(prompts[0][0]).scores == {}
    assert approx.find_matches(prompts[1][0]).scores == {}
    assert approx.find_matches(prompts[2][0]).scores == {(0, 0): 3}
    assert approx.find_matches(newest[0]).scores == {(1, 0): 2}
    assert approx.tracked_blocks() == 5


def test_remove_worker_forgets_its_blocks(clock):
    approx = ApproxKvIndexer(ttl_s=10, clock=clock)
    local, seq = _prompt(1, 2)
    approx.record((1, 0), local, seq)
    approx.record((1, 1), local, seq)
    approx.remove_worker(1)
    assert approx.find_matches(local).scores == {}
    assert approx.tracked_blocks() == 0
