"""The KV index per tier (device, host memory, disk), for both implementations, driven by the real
event types the workers send: offload (``KvRemoved(GPU)`` + ``KvStored(CPU)``), onboard, eviction
to disk, per-tier clears; then the router's cost with tier credit and its explanation."""

from __future__ import annotations

import json
import random

import pytest

from dynamod.daemon.router.core.config import KvRouterConfig, add_router_args, config_from_args
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.hashing import compute_block_hashes, compute_sequence_hashes
from dynamod.shared.kv.index_common import APPLIED, PARENT_MISSING, UNKNOWN_MEDIUM
from dynamod.shared.protocol.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    KvCleared,
    KvRemoved,
    KvStored,
    RouterEvent,
    StoredBlock,
)
from tests.unit.router.kv_impls import IMPLS, NATIVE_CORE, make_index

BS = 4
W1, W2 = (1, 0), (2, 0)


def prompt(n_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def blocks_of(tokens: list[int], salt: int) -> tuple[list[StoredBlock], list[int]]:
    """Stored blocks named by per-worker engine hashes (as vLLM's differ from ours), and the seqs."""
    local = compute_block_hashes(tokens, BS)
    return [StoredBlock(salt * 1000 + i, h) for i, h in enumerate(local)], compute_sequence_hashes(local)


def ev(worker: tuple[int, int], event, eid: int = 0) -> RouterEvent:
    return RouterEvent(worker_id=worker[0], dp_rank=worker[1], event_id=eid, event=event)


@pytest.fixture(params=IMPLS)
def index(request):
    return make_index(request.param)


def offload(index, worker, blocks: list[StoredBlock], parent: int | None, medium_from: str, medium_to: str) -> None:
    """What an engine emits when it moves a chain down a tier."""
    index.apply_event(ev(worker, KvRemoved(block_hashes=[b.block_hash for b in blocks], medium=medium_from)))
    assert index.apply_event(ev(worker, KvStored(parent_hash=parent, blocks=blocks, medium=medium_to))) == APPLIED


def test_offload_to_host_then_disk_gives_per_tier_overlap(index) -> None:
    tokens = prompt(8)
    blocks, seq = blocks_of(tokens, 1)
    index.apply_event(ev(W1, KvStored(parent_hash=None, blocks=blocks)))
    index.apply_event(ev(W2, KvStored(parent_hash=None, blocks=blocks_of(tokens, 2)[0][:2])))
    r = index.find_matches_sequence(seq)
    assert r.scores == {W1: 8, W2: 2} and r.lower == {}
    # The last 5 blocks leave the device for host memory (parent: block 2, still on the device).
    offload(index, W1, blocks[3:], blocks[2].block_hash, MEDIUM_GPU, MEDIUM_CPU)
    r = index.find_matches_sequence(seq)
    assert r.by_medium(W1) == {MEDIUM_GPU: 3, MEDIUM_CPU: 5, MEDIUM_DISK: 0}
    assert r.by_medium(W2) == {MEDIUM_GPU: 2, MEDIUM_CPU: 0, MEDIUM_DISK: 0}
    # The last 2 go on to disk: the continuation goes through host, then disk.
    offload(index, W1, blocks[6:], blocks[5].block_hash, MEDIUM_CPU, MEDIUM_DISK)
    r = index.find_matches_sequence(seq)
    assert r.by_medium(W1) == {MEDIUM_GPU: 3, MEDIUM_CPU: 3, MEDIUM_DISK: 2}
    assert index.find_matches(compute_block_hashes(tokens, BS)).lower == r.lower  # same from local hashes
    assert index.tier_sizes(W1) == {MEDIUM_GPU: 3, MEDIUM_CPU: 3, MEDIUM_DISK: 2}
    # Onboarding back to the device (host copy kept): counted once, on the device.
    index.apply_event(ev(W1, KvStored(parent_hash=blocks[2].block_hash, blocks=blocks[3:6])))
    r = index.find_matches_sequence(seq)
    assert r.by_medium(W1) == {MEDIUM_GPU: 6, MEDIUM_CPU: 0, MEDIUM_DISK: 2}
    assert index.tier_sizes(W1) == {MEDIUM_GPU: 6, MEDIUM_CPU: 3, MEDIUM_DISK: 2}
    index.check_invariants()


def test_continuation_stops_at_a_gap_and_counts_the_fastest_tier(index) -> None:
    tokens = prompt(6)
    blocks, seq = blocks_of(tokens, 1)
    index.apply_event(ev(W1, KvStored(parent_hash=None, blocks=blocks[:1])))
    index.apply_event(ev(W1, KvStored(parent_hash=blocks[0].block_hash, blocks=blocks[1:3], medium=MEDIUM_DISK)))
    index.apply_event(ev(W1, KvStored(parent_hash=blocks[0].block_hash, blocks=blocks[1:2], medium=MEDIUM_CPU)))
    # block 3 missing everywhere; blocks 4, 5 on host (orphans, stored under block 3's name on disk)
    index.apply_event(ev(W1, KvStored(parent_hash=blocks[2].block_hash, blocks=blocks[3:6], medium=MEDIUM_CPU)))
    index.apply_event(ev(W1, KvRemoved(block_hashes=[blocks[3].block_hash], medium=MEDIUM_CPU)))
    r = index.find_matches_sequence(seq)
    assert r.by_medium(W1) == {MEDIUM_GPU: 1, MEDIUM_CPU: 1, MEDIUM_DISK: 1}
    # A host removal leaves the host blocks after it: the engine keeps them.
    assert index.tier_sizes(W1)[MEDIUM_CPU] == 3
    index.check_invariants()


def test_lower_tier_store_with_unknown_parent_is_dropped(index) -> None:
    blocks, _ = blocks_of(prompt(2), 1)
    out = index.apply_event(ev(W1, KvStored(parent_hash=999_999, blocks=blocks, medium=MEDIUM_CPU)))
    assert out == PARENT_MISSING
    assert index.apply_event(ev(W1, KvStored(parent_hash=None, blocks=blocks, medium="NVME"))) == UNKNOWN_MEDIUM
    assert index.tier_sizes(W1) == {MEDIUM_GPU: 0, MEDIUM_CPU: 0, MEDIUM_DISK: 0}


def test_clear_one_tier_or_all_and_remove_worker(index) -> None:
    tokens = prompt(4)
    blocks, seq = blocks_of(tokens, 1)
    index.apply_event(ev(W1, KvStored(parent_hash=None, blocks=blocks[:2])))
    index.apply_event(ev(W1, KvStored(parent_hash=blocks[1].block_hash, blocks=blocks[2:3], medium=MEDIUM_CPU)))
    index.apply_event(ev(W1, KvStored(parent_hash=blocks[2].block_hash, blocks=blocks[3:], medium=MEDIUM_DISK)))
    index.apply_event(ev(W1, KvCleared(medium=MEDIUM_CPU)))
    assert index.tier_sizes(W1) == {MEDIUM_GPU: 2, MEDIUM_CPU: 0, MEDIUM_DISK: 1}
    assert index.find_matches_sequence(seq).by_medium(W1) == {MEDIUM_GPU: 2, MEDIUM_CPU: 0, MEDIUM_DISK: 0}
    index.apply_event(ev(W1, KvCleared(medium=MEDIUM_GPU)))
    assert index.tier_sizes(W1) == {MEDIUM_GPU: 0, MEDIUM_CPU: 0, MEDIUM_DISK: 1}
    index.apply_event(ev(W1, KvStored(parent_hash=None, blocks=blocks[:1], medium=MEDIUM_CPU)))
    index.apply_event(ev(W1, KvCleared()))
    assert index.tier_sizes(W1) == {MEDIUM_GPU: 0, MEDIUM_CPU: 0, MEDIUM_DISK: 0}
    index.apply_event(ev(W1, KvStored(parent_hash=None, blocks=blocks[:1], medium=MEDIUM_DISK)))
    assert index.remove_worker(W1[0]) == [W1]
    assert index.tier_sizes(W1)[MEDIUM_DISK] == 0 and index.dump_events() == []
    index.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_dump_rebuilds_every_tier(impl: str) -> None:
    src = make_index(impl)
    rng = random.Random(5)
    for w, salt in ((W1, 1), (W2, 2)):
        blocks, _ = blocks_of(prompt(10, base=salt), salt)
        src.apply_event(ev(w, KvStored(parent_hash=None, blocks=blocks)))
        cut = rng.randint(1, 5)
        offload(src, w, blocks[cut:], blocks[cut - 1].block_hash, MEDIUM_GPU, MEDIUM_CPU)
        offload(src, w, blocks[cut + 2 :], blocks[cut + 1].block_hash, MEDIUM_CPU, MEDIUM_DISK)
    events = src.dump_events()
    assert {e.event.medium for e in events} == {MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK}
    for other in IMPLS:  # the other implementation rebuilds the same picture (when it was built)
        if other.values[0] == "native" and NATIVE_CORE is None:
            continue
        dst = make_index(other.values[0])
        assert dst.apply_events(events) == 0
        for w, salt in ((W1, 1), (W2, 2)):
            _, seq = blocks_of(prompt(10, base=salt), salt)
            assert dst.tier_sizes(w) == src.tier_sizes(w)
            assert dst.find_matches_sequence(seq).by_medium(w) == src.find_matches_sequence(seq).by_medium(w)
        dst.check_invariants()


# ------------------------------------------------------------------------------------------------
# Cost with tier credit, explanations, metrics.


def make_router(**cfg) -> KvRouter:
    from prometheus_client import CollectorRegistry

    router = KvRouter(KvRouterConfig(**cfg), BS, rng=random.Random(0), registry=CollectorRegistry())
    router.update_workers([W1, W2])
    return router


def feed(router: KvRouter, worker, event, eid: int) -> None:
    router.apply_event(ev(worker, event, eid))


def test_host_blocks_are_credited_at_the_host_weight() -> None:
    tokens = prompt(8)
    router = make_router()
    b1, _ = blocks_of(tokens, 1)
    b2, _ = blocks_of(tokens, 2)
    # W1 holds 2 blocks on the device and 6 on host; W2 holds 4 on the device.
    feed(router, W1, KvStored(parent_hash=None, blocks=b1), 0)
    feed(router, W1, KvRemoved(block_hashes=[b.block_hash for b in b1[2:]]), 1)
    feed(router, W1, KvStored(parent_hash=b1[1].block_hash, blocks=b1[2:], medium=MEDIUM_CPU), 2)
    feed(router, W2, KvStored(parent_hash=None, blocks=b2[:4]), 0)
    d = router.best_worker("r1", tokens)
    by = {(c.worker_id, c.dp_rank): c for c in d.candidates}
    c1 = by[W1]
    assert (c1.overlap_blocks, c1.host_overlap_blocks, c1.disk_overlap_blocks) == (2, 6, 0)
    assert c1.prefill_tokens == 6 * BS and c1.tier_credit_blocks == pytest.approx(4.5)
    assert c1.prefill_blocks == pytest.approx(6 - 4.5)
    assert c1.cost == pytest.approx(1.5 + 6)  # decode: 6 blocks new to its device
    c2 = by[W2]
    assert c2.cost == pytest.approx(4 + 4) and c2.host_overlap_blocks == 0
    assert d.worker == W1  # 7.5 < 8: the host copy wins
    header = json.loads(d.to_header())
    tiers = [(c["worker_id"], c["dp_rank"], c.get("host_overlap_blocks"), c.get("disk_overlap_blocks")) for c in header["candidates"]]
    assert ("0000000000000001", 0, 6, 0) in tiers and ("0000000000000002", 0, None, None) in tiers
    # With no host credit the device prefix wins instead.
    router0 = make_router(host_cache_hit_weight=0.0)
    for w, e, i in ((W1, KvStored(parent_hash=None, blocks=b1), 0), (W1, KvRemoved(block_hashes=[b.block_hash for b in b1[2:]]), 1),
                    (W1, KvStored(parent_hash=b1[1].block_hash, blocks=b1[2:], medium=MEDIUM_CPU), 2),
                    (W2, KvStored(parent_hash=None, blocks=b2[:4]), 0)):
        feed(router0, w, e, i)
    assert router0.best_worker("r1", tokens).worker == W2
    # Routed for real: the metrics count overlap per tier.
    router.select_worker("r2", tokens)
    samples = {s.labels["medium"]: s.value for s in router.metrics.tier_overlap_blocks.collect()[0].samples
               if s.name.endswith("_total")}
    assert samples == {"GPU": 2.0, "CPU": 6.0, "DISK": 0.0}


def test_disk_blocks_are_credited_at_the_disk_weight_and_no_tiers_changes_nothing() -> None:
    tokens = prompt(4)
    router = make_router(disk_cache_hit_weight=0.5)
    b1, _ = blocks_of(tokens, 1)
    feed(router, W1, KvStored(parent_hash=None, blocks=b1[:1]), 0)
    feed(router, W1, KvStored(parent_hash=b1[0].block_hash, blocks=b1[1:], medium=MEDIUM_DISK), 1)
    c1 = {(c.worker_id, c.dp_rank): c for c in router.best_worker("r", tokens).candidates}[W1]
    assert (c1.overlap_blocks, c1.disk_overlap_blocks, c1.tier_credit_blocks) == (1, 3, 1.5)
    assert c1.cost == pytest.approx((3 - 1.5) + 3)
    plain = make_router()
    feed(plain, W1, KvStored(parent_hash=None, blocks=b1[:1]), 0)
    d = plain.best_worker("r", tokens)
    assert all(c.host_overlap_blocks == c.disk_overlap_blocks == 0 for c in d.candidates)
    assert "tiers" not in json.loads(d.to_header())


def test_tier_weight_flags_and_env(monkeypatch) -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_router_args(p)
    assert "--router-host-cache-hit-weight" in p.format_help() and "default 0.75" in p.format_help()
    cfg = config_from_args(p.parse_args([]))
    assert (cfg.host_cache_hit_weight, cfg.disk_cache_hit_weight) == (0.75, 0.25)
    monkeypatch.setenv("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", "0.1")
    cfg = config_from_args(p.parse_args(["--router-host-cache-hit-weight", "0.5"]))
    assert (cfg.host_cache_hit_weight, cfg.disk_cache_hit_weight) == (0.5, 0.1)
    with pytest.raises(ConfigError, match="within \\[0, 1\\]"):
        config_from_args(p.parse_args(["--router-host-cache-hit-weight", "1.5"]))
