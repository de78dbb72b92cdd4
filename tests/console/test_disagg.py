"""The console's picture of a disaggregated cluster: roles and pools, KV transfer rates derived from
cumulative counters, remote vs local prefill decisions, and what ``dynamoctl status`` prints of
them. State is fed recorded messages (``disagg_recording.jsonl``) or hand-made ones; no network."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import msgspec
import pytest

from dynamod.console.ctl import commands
from dynamod.console.present import fmt_bytes_rate, pool_records, pool_row, status_records
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.counter_rates import RATE_WINDOW_S
from dynamod.console.state.decisions import HeardDecision, decode_router_decision
from dynamod.console.tui.views.workers import fit_columns
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.routing import (
    CandidateScore,
    DisaggInfo,
    PublishedDecision,
    RoutingDecision,
    published_decision_encoder,
)
from tests.console.factories import make_state, register
from tests.console.fixtures.make_recording import (
    BLOCK_BYTES,
    DECODE_1,
    DECODE_2,
    DECODE_3,
    DPREFILL_1,
    DPREFILL_2,
)

MB = 1_000_000


def _load(iid: int, ts: float, moved: int, *, dp_rank: int = 0, transfers: int = 1, **kw: object) -> LoadMetrics:
    return LoadMetrics(worker_id=iid, dp_rank=dp_rank, ts=ts, kv_transfer_bytes=moved, kv_transfers=transfers,
                       kv_usage=0.5, total_blocks=100, **kw)  # type: ignore[arg-type]


# -- transfer rates -------------------------------------------------------------------------------


def test_bytes_per_second_from_cumulative_bytes_between_messages() -> None:
    state, _ = make_state()
    register(state, 1, "decode")
    state.apply_load(_load(1, 10.0, 0, transfers=0))
    assert state.transfers.figures(1).bytes_per_s is None  # one message gives no rate
    state.apply_load(_load(1, 11.0, 1 * MB))
    state.apply_load(_load(1, 12.0, 3 * MB, transfers=3))
    fig = state.transfers.figures(1)
    assert fig.bytes_per_s == pytest.approx(1.5 * MB)  # 3 MB over 2 s, on the publisher's clock
    assert (fig.bytes_total, fig.transfers) == (3 * MB, 3)


def test_rate_is_over_a_window_not_between_two_close_messages() -> None:
    """Messages also arrive on change, milliseconds apart: the rate must not spike between them."""
    state, _ = make_state()
    register(state, 1, "decode")
    state.apply_load(_load(1, 10.0, 0))
    state.apply_load(_load(1, 11.0, 1 * MB))
    state.apply_load(_load(1, 11.01, 2 * MB))  # one more transfer 10 ms later
    assert state.transfers.figures(1).bytes_per_s == pytest.approx(2 * MB / 1.01)
    # Old samples leave the window: an idle worker's rate falls to zero.
    t = 11.01
    for _ in range(int(RATE_WINDOW_S) + 2):
        t += 1.0
        state.apply_load(_load(1, t, 2 * MB))
    assert state.transfers.figures(1).bytes_per_s == 0.0


def test_restarted_worker_starts_its_rate_again() -> None:
    state, _ = make_state()
    register(state, 1, "prefill")
    state.apply_load(_load(1, 10.0, 5 * MB, transfers=5))
    state.apply_load(_load(1, 11.0, 6 * MB, transfers=6))
    state.apply_load(_load(1, 12.0, 1000, transfers=1))  # counters began again
    fig = state.transfers.figures(1)
    assert fig.bytes_per_s is None and fig.bytes_total == 1000  # no negative rate
    state.apply_load(_load(1, 13.0, 1000 + 2 * MB, transfers=2))
    assert state.transfers.figures(1).bytes_per_s == pytest.approx(2 * MB)


def test_data_parallel_ranks_sum_and_the_worst_percentile_wins() -> None:
    state, _ = make_state()
    register(state, 1, "decode")
    for ts, moved in ((10.0, 0), (12.0, 2 * MB)):
        state.apply_load(_load(1, ts, moved, dp_rank=0, kv_transfer_ms_p50=2.0, kv_transfer_ms_p99=5.0))
        state.apply_load(_load(1, ts, moved * 2, dp_rank=1, kv_transfer_ms_p50=3.0, kv_transfer_ms_p99=9.0,
                               kv_transfer_failures=1))
    fig = state.transfers.figures(1)
    assert fig.bytes_per_s == pytest.approx(3 * MB)
    assert (fig.p50_ms, fig.p99_ms, fig.failures, fig.transfers) == (3.0, 9.0, 1, 2)


def test_missing_publisher_timestamp_falls_back_to_the_console_clock() -> None:
    state, clock = make_state(50.0)
    register(state, 1, "decode")
    state.apply_load(_load(1, 0.0, 0))
    clock.advance(4.0)
    state.apply_load(_load(1, 0.0, 2 * MB))
    assert state.transfers.figures(1).bytes_per_s == pytest.approx(0.5 * MB)


def test_a_gone_worker_loses_its_rate() -> None:
    state, _ = make_state()
    key = register(state, 1, "decode")
    state.apply_load(_load(1, 10.0, 0))
    state.apply_load(_load(1, 11.0, MB))
    state.delete_instance(key)
    assert state.transfers.figures(1) is None
    assert "decode" not in state.pools()  # a pool counts live workers only


# -- pools ----------------------------------------------------------------------------------------


def _window_rate(recording: list[dict], ids: tuple[int, ...]) -> float:
    """Bytes/s of ``ids`` summed, from their recorded counters RATE_WINDOW_S apart at the end."""
    moved: dict[int, dict[float, int]] = {}
    for rec in recording:
        if rec["kind"] == "kv_metrics" and rec["value"]["worker_id"] in ids:
            moved.setdefault(rec["value"]["worker_id"], {})[rec["value"]["ts"]] = rec["value"].get("kv_transfer_bytes", 0)
    total = 0.0
    for series in moved.values():
        last = max(series)
        total += (series[last] - series[last - RATE_WINDOW_S]) / RATE_WINDOW_S
    return total


def test_pools_from_the_recording(disagg_state: ClusterState, disagg_recording: list[dict]) -> None:
    pools = disagg_state.pools()
    assert list(pools) == ["prefill", "decode"]
    prefill, decode = pools["prefill"], pools["decode"]
    assert (prefill.workers, prefill.ready) == (2, 2)
    assert (decode.workers, decode.ready) == (3, 2)  # decode 3 drains
    assert sorted(decode.worker_ids) == sorted((DECODE_1, DECODE_2, DECODE_3))
    # Last step (39, a multiple of 3): each prefill worker runs one request and has one waiting.
    loads = {iid: disagg_state.stats[iid].loads[0] for iid in (DPREFILL_1, DPREFILL_2, DECODE_1, DECODE_2, DECODE_3)}
    assert prefill.running == 2 and prefill.waiting == 2
    assert decode.running == sum(loads[i].num_running for i in (DECODE_1, DECODE_2, DECODE_3))
    assert decode.kv_total_blocks == 3 * 1024
    assert decode.kv_used_blocks == sum(round(loads[i].kv_usage * 1024) for i in (DECODE_1, DECODE_2, DECODE_3))
    assert decode.kv_avg == pytest.approx(sum(loads[i].kv_usage for i in (DECODE_1, DECODE_2, DECODE_3)) / 3)
    # The rate is over the last RATE_WINDOW_S: bytes moved between the messages 5 s apart.
    for pool, ids in ((prefill, (DPREFILL_1, DPREFILL_2)), (decode, (DECODE_1, DECODE_2, DECODE_3))):
        assert pool.bytes_per_s == pytest.approx(_window_rate(disagg_recording, ids))
    # Three transfers of 16 blocks every two seconds: 1.4 to 1.6 transfers/s in a 5 s window.
    assert 7 / 5 * 16 * BLOCK_BYTES <= decode.bytes_per_s <= 8 / 5 * 16 * BLOCK_BYTES
    assert prefill.transfers == decode.transfers == 60
    assert (decode.failures, prefill.failures) == (1, 0)
    assert decode.p99_ms == pytest.approx(max(8.2 + (i % 3) * 1.5 for i in (DECODE_1, DECODE_2, DECODE_3)))
    assert prefill.p50_ms == 2.5 and prefill.p99_ms == 6.0


def test_agg_pool_shows_no_transfer_figures(recorded_state: ClusterState) -> None:
    agg = recorded_state.pools()["agg"]
    assert agg.workers == 4 and not agg.transfers_seen
    assert pool_row(agg)[6:] == ("-",) * 5


def test_pool_row_and_records_for_dynamoctl(disagg_state: ClusterState) -> None:
    row = pool_row(disagg_state.pools()["decode"])
    assert row[:2] == ("decode", "2/3") and row[6] == fmt_bytes_rate(disagg_state.pools()["decode"].bytes_per_s)
    assert row[6].endswith("MB/s") and row[9] == "1"
    records = {r["pool"]: r for r in pool_records(disagg_state)}
    assert records["prefill"]["ready"] == 2 and records["decode"]["kv_transfer_failures"] == 1
    assert records["decode"]["kv_transfer_bytes_per_s"] == pytest.approx(disagg_state.pools()["decode"].bytes_per_s, abs=0.1)


def test_status_records_carry_role_and_transfers(disagg_state: ClusterState) -> None:
    records = {r["id"]: r for r in status_records(disagg_state)}
    d2 = records[f"{DECODE_2:x}"]
    assert d2["role"] == "decode" and d2["component"] == "backend"
    assert d2["kv_transfer"]["failures"] == 1 and d2["kv_transfer"]["transfers"] > 0
    assert records[f"{DPREFILL_1:x}"]["role"] == "prefill"
    assert records[f"{DPREFILL_1:x}"]["kv_transfer"]["bytes_per_s"] > 0
    frontend = next(r for r in records.values() if r["role"] == "frontend")
    assert frontend["kv_transfer"] is None


def test_fmt_bytes_rate() -> None:
    assert [fmt_bytes_rate(x) for x in (None, 0, 999, 1500, 1.5 * MB, 157 * MB, 2.5e9)] == [
        "-", "0B/s", "999B/s", "1.5kB/s", "1.5MB/s", "157MB/s", "2.5GB/s"]


# -- decisions ------------------------------------------------------------------------------------


def _decision(stage: str, wid: int, disagg: DisaggInfo | None = None, request: str = "r") -> HeardDecision:
    """A decision as the decision publisher sends it, decoded as the console's collector does."""
    c = CandidateScore(wid, 0, 0, 32, 2.0, 8, 10.0, 0)
    rd = RoutingDecision(request_id=request, worker_id=wid, overlap_blocks=0, request_blocks=2, isl=32,
                         reason="only_candidate", detail="", overlap_weight=1.0, temperature=0.0, candidates=[c],
                         stage=stage, disagg=disagg)
    published = PublishedDecision.of(rd, ts=990.0, source="frontend", router_instance_id="1f", model="m")
    return decode_router_decision(published_decision_encoder.encode(published))


def test_decisions_decoded_typed_with_stage_and_disagg(disagg_state: ClusterState) -> None:
    log = disagg_state.decision_log
    assert log.stages == {"prefill": 60, "decode": 80}
    tally = log.disagg
    assert (tally.remote, tally.local) == (60, 20)  # every 4th request had a short prompt
    assert tally.top_reasons("local") == [("isl_bounding", 20)]
    latest = tally.latest[-1]
    assert latest.stage == "decode" and latest.disagg is not None and latest.disagg.mode == "local"
    remote = next(d for d in reversed(log.decisions) if d.disagg is not None and d.disagg.mode == "remote")
    assert remote.why().startswith(f"remote prefill on {remote.disagg.prefill_worker_id:x}; cost ")
    assert latest.explanation().startswith(f"picked {latest.worker_id:x}: local prefill (isl_bounding); cost ")


def test_local_reasons_are_counted_most_frequent_first() -> None:
    state, _ = make_state()
    local = [("prefill_busy", 2), ("no_prefill_workers", 3)]
    for reason, n in local:
        for i in range(n):
            state.apply_router_decision("ns", _decision("decode", 7, DisaggInfo(mode="local", policy="prefill_load", reason=reason),
                                                        request=f"{reason}{i}"))
    state.apply_router_decision("ns", _decision("prefill", 9))
    state.apply_router_decision("ns", _decision("decode", 7, DisaggInfo(mode="remote", policy="prefill_load", reason="always",
                                                                        prefill_worker_id=9)))
    tally = state.decision_log.disagg
    assert (tally.remote, tally.local, tally.total) == (1, 5, 6)
    assert tally.top_reasons("local") == [("no_prefill_workers", 3), ("prefill_busy", 2)]
    assert state.decisions[-1].ts == 990.0 and state.decisions[-1].model == "m"
    assert state.find_worker(7) is None and state.stats[7].routed == 6


# -- what the console and dynamoctl show ------------------------------------------------------------


def test_columns_fit_80_with_role_first_and_never_cut() -> None:
    cols = fit_columns(80, True, {})
    assert cols == ("ID", "ROLE", "STATUS", "RUN", "WAIT", "KV", "TTFT", "ITL", "XFER/S")
    # A one-pool cluster keeps its load sparkline instead of a role column that says agg everywhere.
    assert fit_columns(80, False, {}) == ("ID", "STATUS", "RUN", "WAIT", "KV", "HIT", "TTFT", "ITL", "LOAD")
    # Until a transfer is seen, the transfer columns give way.
    assert "XFER/S" not in fit_columns(80, True, {}, transfers=False)
    wide = fit_columns(200, True, {"COMPONENT": 14, "MODEL": 4, "LORAS": 1, "NODE": 10})
    assert {"XFER50", "XFER99", "XFAIL", "HELD", "COMPONENT", "NODE"} <= set(wide)


def _status_args(**kw: object) -> argparse.Namespace:
    base = {"json": False, "pools": False, "all": False, "wait": 0.0, "timeout": 1.0}
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def ctl_state(monkeypatch: pytest.MonkeyPatch, disagg_state: ClusterState) -> ClusterState:
    """``dynamoctl status`` with its collectors replaced by the recorded cluster."""

    @contextlib.asynccontextmanager
    async def collecting(args: argparse.Namespace, state: ClusterState, sink: object = None, **kw: object) -> AsyncIterator[None]:
        yield None

    monkeypatch.setattr(commands, "_collecting", collecting)
    monkeypatch.setattr(commands, "ClusterState", lambda: disagg_state)
    return disagg_state


def test_dynamoctl_status_shows_roles_and_pools(ctl_state: ClusterState, capsys: pytest.CaptureFixture[str]) -> None:
    assert asyncio.run(commands.status(_status_args())) == 0
    out = capsys.readouterr().out
    table, pools = out.split("\n\n")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert rows[f"{DECODE_3:x}"][1:4] == ["dynamo/backend", "decode", "draining"]
    assert rows[f"{DPREFILL_1:x}"][1:4] == ["dynamo/prefill", "prefill", "ready"]
    assert pools.splitlines()[0].split()[:3] == ["POOL", "READY", "RUN"]
    assert [line.split()[:2] for line in pools.splitlines()[1:]] == [["prefill", "2/2"], ["decode", "2/3"]]


def test_dynamoctl_status_pools_json(ctl_state: ClusterState, capsys: pytest.CaptureFixture[str]) -> None:
    assert asyncio.run(commands.status(_status_args(json=True, pools=True))) == 0
    pools = json.loads(capsys.readouterr().out)
    assert [p["pool"] for p in pools] == ["prefill", "decode"]
    assert pools[1]["workers"] == 3 and pools[1]["kv_transfer_failures"] == 1
    assert asyncio.run(commands.status(_status_args(json=True))) == 0
    roles = {r["id"]: r["role"] for r in json.loads(capsys.readouterr().out)}
    assert roles[f"{DECODE_1:x}"] == "decode" and roles[f"{DPREFILL_2:x}"] == "prefill"


def test_recorded_decisions_are_what_the_router_publishes(disagg_recording: list[dict]) -> None:
    """The fixture's decisions decode as the wire type, so the recording cannot drift from it."""
    for rec in disagg_recording:
        if rec["kind"] == "router_decision":
            msgspec.convert(rec["value"], RoutingDecision)


def test_unmeasured_transfer_times_show_as_unknown_not_zero() -> None:
    """A prefill worker counts reads served but may not time them: 0 ms is "not measured"."""
    state, _ = make_state()
    register(state, 1, "prefill")
    state.apply_load(_load(1, 10.0, MB, transfers=4))
    fig = state.transfers.figures(1)
    assert fig.seen and (fig.p50_ms, fig.p99_ms) == (None, None)
    assert pool_row(state.pools()["prefill"])[7:9] == ("-", "-")
