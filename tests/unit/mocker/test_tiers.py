"""Host and disk KV tiers behind the mocker's device cache: eviction chain, onboarding with the
right bytes, capacities, per-tier clearing and dumps, and the disk tier across restarts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dynamod.daemon.engines.mocker.config import MockerConfigError
from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.engines.mocker.tiers import transfer_ms
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    KvCleared,
    KvRemoved,
    KvStored,
)
from dynamod.shared.protocol.kv_transfer import KvLayout
from tests.unit.mocker.factories import make_config, run_to_completion

BS = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2, block_size=BS)  # 32 B/token
PROMPT_A = list(range(10, 23))  # 13 tokens: 3 full blocks cached, the 4th holds the tail
PROMPT_B = list(range(40, 53))


def tier_core(tmp_path: Path, *, host: int = 2, disk: int = 4, persist: bool = False, **overrides) -> MockerCore:
    config = make_config(
        num_gpu_blocks=4, num_host_blocks=host, num_disk_blocks=disk, disk_cache_dir=str(tmp_path / "disk"),
        disk_cache_persist=persist, host_offload_h2d_bandwidth_gbps=1.0, disk_offload_read_bandwidth_gbps=0.5,
        **overrides,
    )
    memory = KvBlockMemory(config.num_gpu_blocks, LAYOUT.block_bytes)
    return MockerCore(config, kv_memory=memory, kv_layout=LAYOUT)


def run(core: MockerCore, rid: str, prompt: list[int]) -> list:
    core.add_request(rid, prompt, max_tokens=1, ignore_eos=True)
    return run_to_completion(core)


def events(outs) -> list:
    return [e for out in outs for e in out.kv_events]


def gpu_rows(core: MockerCore, hashes: list[int]) -> np.ndarray:
    pool = core.kv_manager.block_pool
    return np.stack([core.kv_writer.memory.array[pool.cached_block_hash_to_block[h].block_id] for h in hashes])


def io_idle(core: MockerCore) -> None:
    """Waits for the disk tier's background writes and deletes (the files lag the index)."""
    assert core.tiers.io.wait_idle(10.0), "disk tier I/O did not finish"


def stored_hashes(evs, medium: str) -> list[int]:
    return [b.block_hash for e in evs if isinstance(e, KvStored) and e.medium == medium for b in e.blocks]


def test_device_evictions_go_to_host_then_disk_with_medium_events(tmp_path):
    core = tier_core(tmp_path)
    first = events(run(core, "a", PROMPT_A))
    a_hashes = stored_hashes(first, MEDIUM_GPU)
    assert len(a_hashes) == 3
    evs = events(run(core, "b", PROMPT_B))  # needs all 4 device blocks: A's 3 cached ones leave
    removed_gpu = [h for e in evs if isinstance(e, KvRemoved) and e.medium == MEDIUM_GPU for h in e.block_hashes]
    assert sorted(removed_gpu) == sorted(a_hashes)
    in_host, in_disk = stored_hashes(evs, MEDIUM_CPU), stored_hashes(evs, MEDIUM_DISK)
    # Host holds 2; the oldest evicted block went straight on to disk, never announced as CPU.
    assert len(in_host) == 2 and len(in_disk) == 1 and set(in_host) | set(in_disk) == set(a_hashes)
    assert set(core.tiers.host.entries) == set(in_host) and set(core.tiers.disk.entries) == set(in_disk)
    io_idle(core)
    files = sorted(p.name for p in (tmp_path / "disk" / "dp0").iterdir())
    assert files == [f"{in_disk[0]:016x}.kvb"]
    # Every GPU removal precedes the lower-tier stores of the same step.
    kinds = [(type(e).__name__, e.medium) for e in evs if not isinstance(e, KvCleared)]
    assert kinds.index(("KvRemoved", MEDIUM_GPU)) < kinds.index(("KvStored", MEDIUM_CPU))


def test_a_prefix_in_lower_tiers_is_onboarded_with_its_bytes(tmp_path):
    core = tier_core(tmp_path)
    first = events(run(core, "a", PROMPT_A))
    a_hashes = stored_hashes(first, MEDIUM_GPU)
    original = gpu_rows(core, a_hashes).copy()
    run(core, "b", PROMPT_B)  # A leaves the device: 2 blocks to host, 1 to disk
    core.kv_writer.memory.array[:] = 0  # nothing of A's bytes left on the device

    outs = run(core, "a2", PROMPT_A)
    [fin] = [f for out in outs for f in out.finished]
    assert fin.usage.cached_tokens == 12  # 3 blocks onboarded, only the last token prefilled
    assert outs[0].num_prefill_tokens == 1
    block_bytes = LAYOUT.block_bytes
    expected_ms = transfer_ms(3 * block_bytes, 1.0) + transfer_ms(block_bytes, 0.5)  # all h2d, one disk read
    assert outs[0].onboard_ms == pytest.approx(expected_ms)
    assert outs[0].duration_ms == pytest.approx(outs[0].prefill_ms + outs[0].decode_ms + expected_ms)
    assert np.array_equal(gpu_rows(core, a_hashes), original)
    assert sorted(stored_hashes(events(outs), MEDIUM_GPU)) == sorted(a_hashes)
    load = core.load()
    assert load.tiers[MEDIUM_CPU].hit_tokens + load.tiers[MEDIUM_DISK].hit_tokens == 12
    assert load.tiers[MEDIUM_DISK].onboarded_blocks == 1 and load.tiers[MEDIUM_CPU].onboarded_blocks == 2


def test_capacities_hold_and_the_last_tier_drops_its_oldest(tmp_path):
    core = tier_core(tmp_path, host=1, disk=2)
    all_evs = []
    for i in range(5):
        all_evs += events(run(core, f"r{i}", [i * 20 + t for t in range(13)]))
        assert len(core.tiers.host) <= 1 and len(core.tiers.disk) <= 2
    assert len(core.tiers.host) == 1 and len(core.tiers.disk) == 2
    dropped = [h for e in all_evs if isinstance(e, KvRemoved) and e.medium == MEDIUM_DISK for h in e.block_hashes]
    assert dropped and not set(dropped) & set(core.tiers.disk.entries)
    io_idle(core)
    assert len(list((tmp_path / "disk" / "dp0").glob("*.kvb"))) == 2


def test_clear_one_tier_or_all_and_dump_lists_every_tier(tmp_path):
    core = tier_core(tmp_path)
    run(core, "a", PROMPT_A)
    run(core, "b", PROMPT_B)
    media = sorted({d.medium for d in core.kv_dump()})
    assert media == [MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU]
    assert core.clear_kv_blocks(MEDIUM_CPU) == 2
    assert core.take_events() == [KvCleared(medium=MEDIUM_CPU)]
    assert len(core.tiers.host) == 0 and len(core.tiers.disk) == 1
    assert core.clear_kv_blocks(MEDIUM_GPU) == 3
    assert core.take_events() == [KvCleared(medium=MEDIUM_GPU)]
    assert core.clear_kv_blocks() == 1
    assert core.take_events() == [KvCleared()]
    io_idle(core)
    assert core.kv_dump() == [] and not list((tmp_path / "disk" / "dp0").glob("*.kvb"))
    with pytest.raises(Exception, match="unknown KV tier"):
        core.clear_kv_blocks("NVME")


def test_disk_tier_survives_a_restart_only_when_persistent(tmp_path):
    core = tier_core(tmp_path, host=0, disk=8, persist=True)
    first = events(run(core, "a", PROMPT_A))
    a_hashes = stored_hashes(first, MEDIUM_GPU)
    original = gpu_rows(core, a_hashes).copy()
    run(core, "b", PROMPT_B)  # A goes straight to disk (no host tier)
    assert set(core.tiers.disk.entries) == set(a_hashes)
    core.close()

    again = tier_core(tmp_path, host=0, disk=8, persist=True)
    announced = again.take_events()
    assert sorted(stored_hashes(announced, MEDIUM_DISK)) == sorted(a_hashes)
    outs = run(again, "a2", PROMPT_A)
    assert outs[-1].finished[0].usage.cached_tokens == 12
    assert np.array_equal(gpu_rows(again, a_hashes), original)
    again.close()
    assert (tmp_path / "disk" / "dp0").exists()

    throwaway = tier_core(tmp_path, host=0, disk=8, persist=False)
    assert throwaway.take_events() == [] and len(throwaway.tiers.disk) == 0  # old files are not reused
    run(throwaway, "a", PROMPT_A)
    run(throwaway, "b", PROMPT_B)
    io_idle(throwaway)
    assert list((tmp_path / "disk" / "dp0").glob("*.kvb"))
    throwaway.close()
    assert not (tmp_path / "disk" / "dp0").exists()


def test_tiers_without_bytes_keep_the_index_and_timing_only():
    config = make_config(num_gpu_blocks=4, num_host_blocks=4, host_offload_h2d_bandwidth_gbps=10.0, kv_bytes_per_token=1000)
    core = MockerCore(config)
    run(core, "a", PROMPT_A)
    run(core, "b", PROMPT_B)
    outs = run(core, "a2", PROMPT_A)
    assert outs[-1].finished[0].usage.cached_tokens == 12
    assert outs[0].onboard_ms == pytest.approx(transfer_ms(3 * 4 * 1000, 10.0))


def test_tier_flags_are_checked():
    with pytest.raises(MockerConfigError, match="--num-host-blocks"):
        make_config(num_host_blocks=-1)
    with pytest.raises(MockerConfigError, match="prefix caching"):
        make_config(num_host_blocks=4, enable_prefix_caching=False)
    with pytest.raises(MockerConfigError, match="bandwidth"):
        make_config(num_host_blocks=4, host_offload_h2d_bandwidth_gbps=-1.0)


def test_worker_metrics_export_tier_load_as_counters_and_gauges():
    from prometheus_client import CollectorRegistry

    from dynamod.daemon.worker.metrics import WorkerMetrics
    from dynamod.shared.protocol.load import KvTierLoad, LoadMetrics

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    for onboarded in (3, 5):
        metrics.load(LoadMetrics(worker_id=0xAB, kv_tiers={"CPU": KvTierLoad(
            blocks=2, total_blocks=4, usage=0.5, hit_tokens=onboarded * 4, onboarded_blocks=onboarded, offloaded_blocks=7)}))
    labels = {"worker_id": "00000000000000ab", "dp_rank": "0", "medium": "CPU"}
    assert registry.get_sample_value("dynamo_component_kv_tier_usage_percent", labels) == 0.5
    assert registry.get_sample_value("dynamo_component_kv_tier_onboarded_blocks_total", labels) == 5
    assert registry.get_sample_value("dynamo_component_kv_tier_hit_tokens_total", labels) == 20
    assert registry.get_sample_value("dynamo_component_kv_tier_offloaded_blocks_total", labels) == 7


def test_a_block_pushed_out_and_offloaded_again_in_one_flush_stays_known():
    """Host [1, 2] takes evictions 4, 3, 1: block 1 is pushed out by 3 and comes back with the
    third eviction. A router replaying the events must still know 1 is in the host tier (the
    events are the net change per hash, not a second store followed by a removal)."""
    from dynamod.daemon.engines.mocker.block_pool import KVBlock
    from dynamod.daemon.engines.mocker.tiers import TierBandwidth, TieredKvCache

    def evicted(*hashes: int) -> list[KVBlock]:
        blocks = []
        for h in hashes:
            block = KVBlock(h)
            block.block_hash = h
            blocks.append(block)
        return blocks

    tiers = TieredKvCache(num_host_blocks=3, num_disk_blocks=0, block_bytes=64, bandwidth=TierBandwidth())
    tiers.on_evict(evicted(1, 2))
    tiers.flush()
    tiers.take_events()
    tiers.on_evict(evicted(4, 3, 1))
    tiers.flush()
    view = {1, 2}
    for event in tiers.take_events():
        assert event.medium == MEDIUM_CPU
        if isinstance(event, KvStored):
            new = {b.block_hash for b in event.blocks}
            assert not new & view
            view |= new
        else:
            assert set(event.block_hashes) <= view
            view -= set(event.block_hashes)
    assert view == set(tiers.host.entries) == {4, 3, 1}


def test_lower_tier_stores_name_each_parent_before_its_children(tmp_path):
    """A request frees its blocks tail first, so the device evicts a chain child first; the host
    tier's stores must still come parent first: a router drops a stored block whose parent it does
    not hold, and the device has just removed it."""
    core = tier_core(tmp_path, host=4, disk=0)
    a_hashes = stored_hashes(events(run(core, "a", PROMPT_A)), MEDIUM_GPU)
    evs = events(run(core, "b", PROMPT_B))
    cpu = [e for e in evs if isinstance(e, KvStored) and e.medium == MEDIUM_CPU]
    assert [b.block_hash for e in cpu for b in e.blocks] == a_hashes
    assert len(cpu) == 1 and cpu[0].parent_hash is None  # one run, from the chain's root
