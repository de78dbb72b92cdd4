"""Per-worker KV tier figures in the console: state from ``kv_metrics``' ``kv_tiers`` (usage, hit
tokens, onboard/offload rates over the publisher's timestamps) and the worker detail screen."""

from __future__ import annotations

from dynamod.console.state.tiers import KvTierTracker
from dynamod.shared.protocol.load import KvTierLoad, LoadMetrics


def load(ts: float, onboarded: int, offloaded: int, *, rank: int = 0, blocks: int = 50) -> LoadMetrics:
    return LoadMetrics(
        worker_id=7,
        dp_rank=rank,
        ts=ts,
        kv_tiers={
            "CPU": KvTierLoad(blocks=blocks, total_blocks=200, usage=blocks / 200, hit_tokens=640,
                              onboarded_blocks=onboarded, offloaded_blocks=offloaded),
            "DISK": KvTierLoad(blocks=10, total_blocks=1000, offloaded_blocks=offloaded // 2),
        },
    )


def test_usage_hits_and_rates_per_tier() -> None:
    t = KvTierTracker()
    t.observe(load(100.0, 0, 0), now=0.0)
    first = t.figures(7)["CPU"]
    assert first.usage == 0.25 and first.hit_tokens == 640 and first.onboard_per_s is None
    t.observe(load(102.0, 20, 60), now=0.0)
    cpu, disk = t.figures(7)["CPU"], t.figures(7)["DISK"]
    assert (cpu.onboard_per_s, cpu.offload_per_s) == (10.0, 30.0)
    assert (disk.offload_per_s, disk.usage) == (15.0, 0.01)
    # A second rank adds up; a counter going back (restart) restarts that rank's rate.
    t.observe(load(102.0, 5, 5, rank=1, blocks=150), now=0.0)
    cpu = t.figures(7)["CPU"]
    assert (cpu.blocks, cpu.total_blocks, cpu.usage) == (200, 400, 0.5)
    t.observe(load(103.0, 1, 1), now=0.0)
    assert t.figures(7)["CPU"].onboard_per_s is None
    t.retain(set())
    assert t.figures(7) == {}


def test_workers_without_tiers_cost_nothing() -> None:
    t = KvTierTracker()
    t.observe(LoadMetrics(worker_id=3, kv_usage=0.5), now=1.0)
    assert t.figures(3) == {}
