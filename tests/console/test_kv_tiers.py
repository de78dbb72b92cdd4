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


def test_tier_cell_shows_only_the_tiers_a_worker_has() -> None:
    from dynamod.console.present import fmt_tiers
    from dynamod.console.state.tiers import TierFigures

    assert fmt_tiers({}) == "-"
    assert fmt_tiers({"DISK": TierFigures(blocks=1, total_blocks=8), "CPU": TierFigures(blocks=5, total_blocks=8)}) == "H62 D12"
    assert fmt_tiers({"CPU": TierFigures(blocks=8, total_blocks=8)}) == "H100"
    assert fmt_tiers({"DISK": TierFigures()}) == "D-"  # capacity not known yet


def test_workers_table_and_dynamoctl_status_gain_a_tier_column_only_with_tiers() -> None:
    from dynamod.console.present import TIER_COLUMN, status_records, status_table
    from dynamod.console.tui.views.workers import fit_columns
    from tests.console.factories import make_state, register

    assert TIER_COLUMN not in fit_columns(200, False, {})
    wide = fit_columns(200, False, {}, tiers=True)
    assert wide.index(TIER_COLUMN) == wide.index("KV") + 1
    assert TIER_COLUMN in fit_columns(80, False, {}, tiers=True)  # it outranks the sparkline at 80 columns

    state, _ = make_state()
    register(state, 0x11)
    register(state, 0x22)
    state.apply_load(LoadMetrics(worker_id=0x11, kv_usage=0.5, total_blocks=100, ts=1000.0))
    columns, rows = status_table(state)
    assert TIER_COLUMN not in columns and all(len(r) == len(columns) for r in rows)
    assert all(r["kv_tiers"] is None for r in status_records(state))

    state.apply_load(LoadMetrics(worker_id=0x22, kv_usage=0.5, total_blocks=100, ts=1000.0, kv_tiers={
        "CPU": KvTierLoad(blocks=30, total_blocks=100, hit_tokens=64),
        "DISK": KvTierLoad(blocks=5, total_blocks=1000)}))
    columns, rows = status_table(state)
    at = columns.index(TIER_COLUMN)
    assert columns[at - 1] == "KV" and all(len(r) == len(columns) for r in rows)
    assert {r[0]: r[at] for r in rows} == {"0000000000000011": "-", "0000000000000022": "H30 D0"}
    records = {r["id"]: r["kv_tiers"] for r in status_records(state)}
    assert records["0000000000000011"] is None
    assert records["0000000000000022"]["CPU"] == {"usage": 0.3, "blocks": 30, "total_blocks": 100, "hit_tokens": 64,
                                    "onboard_blocks_per_s": None, "offload_blocks_per_s": None}
