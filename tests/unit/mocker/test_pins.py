"""Pinned prefixes in the mocker (cache_control): the pin table, the device pool holding pinned
blocks through an eviction storm, expiry and refresh, the pinned-share bound, usage accounting,
clearing, and the lower tiers pushing pinned hashes out last."""

from __future__ import annotations

import pytest

from dynamod.daemon.engines.mocker.config import MockerConfigError
from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.engines.mocker.pins import PinTable
from dynamod.daemon.engines.mocker.tier_entry import TierEntry
from dynamod.daemon.engines.mocker.tiers import LruTier
from dynamod.shared.protocol.kv_events import MEDIUM_CPU, MEDIUM_GPU
from dynamod.shared.protocol.llm import PrefixPin
from tests.unit.mocker.factories import finished_by_request, make_config, run_to_completion

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prompt(seed: int) -> list[int]:
    """13 tokens: 3 full blocks can hit (the last token is always computed), the 4th holds the tail."""
    return [(seed * 7 + i) % 97 + 1 for i in range(13)]


def pinned_core(clock: FakeClock, **overrides) -> MockerCore:
    core = MockerCore(make_config(num_gpu_blocks=16, **overrides))
    core.kv_manager.pins.clock = clock
    return core


def run(core: MockerCore, rid: str, tokens: list[int], pin: PrefixPin | None = None):
    core.add_request(rid, tokens, max_tokens=1, ignore_eos=True, pin=pin)
    return finished_by_request(run_to_completion(core))[rid].usage


def storm(core: MockerCore, n: int = 12, base: int = 100) -> None:
    """Distinct prompts enough to cycle the whole 16-block cache several times."""
    for i in range(n):
        run(core, f"storm-{base + i}", prompt(base + i))


# -- the table ------------------------------------------------------------------------------------


def test_table_pins_refreshes_and_expires_lazily():
    clock = FakeClock()
    table = PinTable(max_blocks=4, clock=clock)
    out = table.pin([1, 2, 3], ttl_s=10)
    assert out.new == [1, 2, 3] and out.refreshed == 0 and not out.refused
    clock.now += 8
    again = table.pin([1, 2], ttl_s=10)  # the same prefix again: extended, nothing new
    assert again.new == [] and again.refreshed == 2
    clock.now += 3  # 11 s after the first pin: 3 has expired, 1 and 2 were extended to 18
    assert table.expired() == [3]
    assert table.is_pinned(1) and not table.is_pinned(3)
    table.refresh([1])  # a cache hit: another TTL of its own from now
    clock.now += 8  # 19: 2 has run out, 1 lives until 21
    assert table.expired() == [2]
    assert table.expired() == []
    clock.now += 3
    assert table.expired() == [1] and len(table) == 0


def test_table_refuses_a_pin_past_its_bound_whole_but_refreshes_what_it_holds():
    clock = FakeClock()
    table = PinTable(max_blocks=3, clock=clock)
    table.pin([1, 2], ttl_s=10)
    clock.now += 5
    out = table.pin([1, 2, 7, 8], ttl_s=10)  # two new blocks would make 4 > 3
    assert out.refused and out.new == [] and out.refreshed == 2
    assert 7 not in table and 8 not in table and table.expiry(1) == clock.now + 10
    assert table.num_refused == 1
    with pytest.raises(ValueError, match="TTL"):
        table.pin([9], ttl_s=0)


# -- the device pool ------------------------------------------------------------------------------


def test_pinned_prefix_survives_an_eviction_storm_that_evicts_an_unpinned_one():
    clock = FakeClock()
    core = pinned_core(clock)
    a, b = prompt(1), prompt(2)
    usage_a = run(core, "a", a, PrefixPin(num_tokens=12, ttl_s=300))
    assert usage_a.pinned_tokens == 12 and usage_a.cached_tokens == 0 and not usage_a.pin_refused
    load = core.load()  # the pinned blocks are cache, not running sequences
    assert load.active_blocks == 0 and load.total_blocks - core.kv_manager.num_free_blocks == 3
    assert run(core, "b", b).pinned_tokens == 0
    storm(core)
    again_b = run(core, "b2", b)
    again_a = run(core, "a2", a)
    assert again_b.cached_tokens == 0  # evicted by the storm
    assert again_a.cached_tokens == 12  # the whole pinned prefix
    assert again_a.pinned_tokens == 0  # nothing new was pinned
    pool = core.kv_manager.block_pool
    assert core.kv_manager.num_pinned_blocks == 3
    # The pin holds one reference per block: they sit outside the free list.
    assert all(pool.cached_block_hash_to_block[h].ref_cnt == 1 for h in core.kv_manager.pins.hashes())


def test_pin_counts_whole_blocks_and_only_tokens_beyond_the_cache_hit_as_created():
    clock = FakeClock()
    core = pinned_core(clock)
    a = prompt(3)
    run(core, "warm", a)  # cached, not pinned
    usage = run(core, "a", a + [5, 6, 7, 8], PrefixPin(num_tokens=15, ttl_s=60))  # 15 tokens -> 3 blocks
    assert usage.cached_tokens == 12
    assert usage.pinned_tokens == 0  # the 3 blocks were read from the cache, not created
    assert core.kv_manager.num_pinned_blocks == 3


def test_pin_expires_then_the_prefix_is_evictable_again():
    clock = FakeClock()
    core = pinned_core(clock)
    a = prompt(4)
    run(core, "a", a, PrefixPin(num_tokens=12, ttl_s=300))
    clock.now += 301
    storm(core)
    assert core.kv_manager.num_pinned_blocks == 0
    assert run(core, "a2", a).cached_tokens == 0
    assert core.kv_manager.pins.num_expired == 3


def test_a_later_pin_or_a_hit_extends_the_pin():
    clock = FakeClock()
    core = pinned_core(clock)
    a = prompt(5)
    run(core, "a", a, PrefixPin(num_tokens=12, ttl_s=300))
    clock.now += 200
    assert run(core, "a2", a, PrefixPin(num_tokens=12, ttl_s=300)).cached_tokens == 12  # refresh by pin
    clock.now += 200  # 400 s after the first pin, 200 after the refresh
    assert run(core, "a3", a).cached_tokens == 12  # a hit also refreshes: 300 s from now
    clock.now += 250
    storm(core)
    assert run(core, "a4", a).cached_tokens == 12
    clock.now += 301
    storm(core, base=200)
    assert run(core, "a5", a).cached_tokens == 0


def test_pin_past_the_fraction_bound_is_refused_and_the_request_runs_unpinned():
    clock = FakeClock()
    core = pinned_core(clock, max_pinned_fraction=0.25)  # 4 of 16 blocks
    a, b = prompt(6), prompt(7)
    assert run(core, "a", a, PrefixPin(num_tokens=12, ttl_s=300)).pinned_tokens == 12
    usage = run(core, "b", b, PrefixPin(num_tokens=12, ttl_s=300))  # 3 more would make 6 > 4
    assert usage.pin_refused and usage.pinned_tokens == 0 and usage.completion_tokens == 1
    assert core.kv_manager.num_pinned_blocks == 3
    storm(core)
    assert run(core, "b2", b).cached_tokens == 0
    assert run(core, "a2", a).cached_tokens == 12


def test_pins_give_way_soonest_expiry_first_to_a_request_that_could_never_fit_beside_them():
    # Found by bench/agents.py: pins holding half the cache left a long prompt waiting for their TTL.
    clock = FakeClock()
    core = pinned_core(clock)  # 16 blocks, pins may hold 8
    a, b = prompt(11), prompt(12)
    assert run(core, "a", a, PrefixPin(num_tokens=12, ttl_s=100)).pinned_tokens == 12
    assert run(core, "b", b, PrefixPin(num_tokens=12, ttl_s=300)).pinned_tokens == 12
    long = [(i * 13) % 89 + 1 for i in range(49)]  # 13 blocks: only 10 are free of pins
    usage = run(core, "long", long)
    assert usage.completion_tokens == 1
    assert core.kv_manager.pins.num_yielded == 3  # a's pin (the soonest to expire), no more
    assert run(core, "b2", b).cached_tokens == 12
    assert core.kv_manager.num_pinned_blocks == 3


def test_zero_fraction_refuses_every_pin_and_bad_fraction_is_a_config_error():
    core = pinned_core(FakeClock(), max_pinned_fraction=0.0)
    assert run(core, "a", prompt(8), PrefixPin(num_tokens=12, ttl_s=300)).pin_refused
    with pytest.raises(MockerConfigError, match="--max-pinned-fraction"):
        make_config(max_pinned_fraction=1.5)


def test_clearing_the_device_cache_drops_pins_and_frees_their_blocks():
    clock = FakeClock()
    core = pinned_core(clock)
    run(core, "a", prompt(9), PrefixPin(num_tokens=12, ttl_s=300))
    assert core.kv_manager.num_free_blocks == 13
    core.clear_kv_blocks(MEDIUM_GPU)
    assert core.kv_manager.num_pinned_blocks == 0
    assert core.kv_manager.num_free_blocks == 16
    storm(core)  # every block is allocatable again
    assert run(core, "a2", prompt(9)).cached_tokens == 0


# -- the lower tiers ------------------------------------------------------------------------------


def test_lru_tier_pushes_out_unpinned_entries_first_and_pinned_ones_when_nothing_else_is_left():
    pinned = {2, 3}
    tier = LruTier(MEDIUM_CPU, capacity=3)
    tier.is_pinned = pinned.__contains__
    for h in (1, 2, 3):
        assert tier.insert(TierEntry(h, h, None, None)) == []
    out = tier.insert(TierEntry(4, 4, None, None))
    assert [e.block_hash for e in out] == [1]
    out = tier.insert(TierEntry(5, 5, None, None))  # 2 and 3 are pinned: 4 goes
    assert [e.block_hash for e in out] == [4]
    assert set(tier.entries) == {2, 3, 5}
    pinned.update({5, 6})
    out = tier.insert(TierEntry(6, 6, None, None))  # all pinned: the least recently used goes
    assert len(out) == 1 and len(tier) == 3


def test_host_tier_keeps_the_copy_of_a_pinned_prefix_through_offload_pressure():
    clock = FakeClock()
    core = pinned_core(clock, num_host_blocks=3)
    a = prompt(10)
    run(core, "warm", a)
    storm(core, n=5)  # the 5th evicts a's blocks (the oldest) to the 3-block host tier
    host = core.tiers.host
    usage = run(core, "a", a, PrefixPin(num_tokens=12, ttl_s=300))  # onboarded, then pinned
    assert usage.cached_tokens == 12
    pinned = set(core.kv_manager.pins.hashes())
    assert pinned and pinned <= set(host.entries)  # the onboard left the host copies
    storm(core, n=6, base=300)  # offloads push the host tier's LRU out, skipping the pinned copies
    assert pinned <= set(host.entries)
    clock.now += 301
    core.kv_manager.expire_pins()
    storm(core, n=6, base=400)
    assert not pinned & set(host.entries)
