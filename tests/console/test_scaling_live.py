"""Live scaling figures (issue 22 item 5, issue 24 item 14): ``dynamoctl planner status`` and the
console show the same REQ/S, QUEUE, ISL, OSL, TTFT and ITL, read from the planner's status record
(one source, one formatter); the Scaling view plots desired vs ready replicas against load and the
SLA targets over time, readable at 80x24, from a recorded ``dynamod up --planner`` run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from rich.console import Console
from textual.widgets import Static

from dynamod.console.ctl.main import main as dynamoctl
from dynamod.console.present import SCALING_COLUMNS, scaling_row
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import read_records, replay
from dynamod.console.state.scaling_history import ScalingHistory
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.views.scaling_plot import BARS, scaling_plot, spark
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.protocol.keys import planner_status_key
from dynamod.shared.protocol.planner import PlannerStatus, PoolStatus
from tests.console.factories import NAMESPACE as NS
from tests.console.factories import make_state
from tests.console.live import collecting
from tests.console.pilot import until

SCALING_RECORDING = Path(__file__).parent / "fixtures" / "scaling_recording.jsonl"
LIVE = ("REQ/S", "QUEUE", "ISL", "OSL", "TTFT", "ITL")


def live_status(decision_id: int = 5, *, ready: int = 1, desired: int = 2, waiting: float = 12.0,
                ttft: float = 3400.0) -> PlannerStatus:
    """A load planner's status mid-burst: 1 ready, 2 wanted, 12 requests queued."""
    return PlannerStatus(
        namespace=NS, planner="load", connector="local", interval_s=1.0, last_decision_id=decision_id,
        ts=1000.0 + decision_id, targets={"ttft_ms": 2000.0, "itl_ms": 50.0},
        pools={"agg": PoolStatus(component="backend", current=ready, desired=desired, min_replicas=1, max_replicas=3,
                                 load={"waiting": waiting, "running": 8.0, "kv_usage": 0.94},
                                 action="scale_up", reason="queue_backlog")},
        observed={"request_rate": 6.5, "isl": 210.0, "osl": 48.0, "ttft_ms": ttft, "itl_ms": 31.0},
    )


def _cells(row: tuple[str, ...]) -> dict[str, str]:
    return {c: row[SCALING_COLUMNS.index(c)] for c in LIVE}


# -- one source for dynamoctl and the console ---------------------------------------------------------


async def test_dynamoctl_and_the_console_show_the_same_live_figures(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The planner's status in real file discovery: ``dynamoctl planner status`` (one listing) and
    the console (its collectors' watch) print the same live cells, none of them ``-``."""
    store = make_store("file", file_root=str(tmp_path))
    await store.start()
    try:
        await store.put(planner_status_key(NS), msgspec.json.encode(live_status()))
    finally:
        await store.close()

    argv = ["planner", "status", "--discovery", "file", "--file-kv", str(tmp_path), "--namespace", NS]
    assert await asyncio.to_thread(dynamoctl, argv) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    line = next(x for x in out if x.startswith(f"{NS}/agg")).split()
    ctl = {c: line[header.index(c)] for c in LIVE}
    assert ctl == {"REQ/S": "6.5/s", "QUEUE": "12", "ISL": "210", "OSL": "48", "TTFT": "3400/2000ms",
                   "ITL": "31/50ms"}, out
    assert " ".join(line).endswith("scale_up queue_backlog")  # LAST, without the decision stream

    assert await asyncio.to_thread(dynamoctl, [*argv[:2], "--json", *argv[2:]]) == 0
    doc = msgspec.json.decode(capsys.readouterr().out)
    (pool,) = doc["pools"]
    assert pool["observed"]["request_rate"] == 6.5 and pool["load"]["waiting"] == 12.0
    assert pool["measured"]["ttft_ms"] == 3400.0

    async with collecting(tmp_path, NS) as state:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not state.scaling_pools():
            assert loop.time() < deadline, "the planner status never reached the console"
            await asyncio.sleep(0.05)
        (p,) = state.scaling_pools()
        assert _cells(scaling_row(p)) == ctl
        assert scaling_row(p)[-1] == "scale_up queue_backlog"


def test_the_planners_figures_win_over_the_consoles_scrapes() -> None:
    """With a planner reporting, TTFT/ITL are its figures in both tools; the console's own scrapes
    stand in only while no planner measured them."""
    state, _ = make_state()
    state.apply_discovery(planner_status_key(NS), live_status())
    (p,) = state.scaling_pools()
    p.measured.ttft_p50 = 90.0  # what a console-only scrape would say
    assert p.ttft_ms == 3400.0
    p.observed = {}
    assert p.ttft_ms == 90.0


# -- the history model ----------------------------------------------------------------------------------


def test_history_samples_once_per_interval_and_starts_over_with_a_new_planner() -> None:
    history = ScalingHistory(capacity=4)
    assert not history.add_status(live_status(0))  # nothing decided yet
    assert history.add_status(live_status(1, ready=1, desired=1))
    assert not history.add_status(live_status(1, ready=1, desired=3))  # same interval rewritten
    for i in range(2, 7):
        history.add_status(live_status(i, ready=min(i, 3), desired=3))
    samples = history.samples(NS, "agg")
    assert [s.decision_id for s in samples] == [3, 4, 5, 6]  # capacity keeps the newest
    assert [(s.ready, s.desired, s.waiting, s.request_rate) for s in samples][-1] == (3, 3, 12.0, 6.5)
    history.add_status(live_status(1))  # a restarted planner counts from 1 again
    assert [s.decision_id for s in history.samples(NS, "agg")] == [1]


def test_an_override_is_what_the_plot_shows_as_wanted() -> None:
    history = ScalingHistory()
    st = live_status(3)
    st.pools["agg"].override = 3
    history.add_status(st)
    assert history.samples(NS, "agg")[0].desired == 3


# -- the plot -------------------------------------------------------------------------------------------


def test_spark_scales_and_leaves_gaps_blank() -> None:
    assert spark([0.0, 1.5, 3.0, None], 3.0) == BARS[0] + BARS[4] + BARS[7] + " "
    assert spark([5.0], 0.0) == BARS[0]


def _plot_lines(state: ClusterState, width: int) -> list[str]:
    (p,) = state.scaling_pools()
    plot = scaling_plot(p, width)
    assert plot is not None
    console = Console(width=width, record=True, color_system=None)
    console.print(plot)
    return console.export_text().splitlines()


def test_the_recorded_burst_reads_in_order() -> None:
    """From the recorded run: the load rises, the planner wants more before the workers are
    ready, the queue and TTFT fall once they are, and both counts come back down after it."""
    state = replay(read_records(SCALING_RECORDING))
    (p,) = state.scaling_pools()
    want = [s.desired for s in p.history]
    ready = [s.ready for s in p.history]
    assert max(want) == 3 and want[0] == want[-1] == 1 and ready[-1] == 1
    first_up = next(i for i, w in enumerate(want) if w > 1)
    assert ready[first_up] == 1 and ready.index(2) > first_up  # ready lags wanted
    lines = _plot_lines(state, 78)
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == ["want", "ready", "req/s", "queue", "TTFT", "ITL"]
    assert all(len(line) <= 78 for line in lines)
    # Same column = same interval in every row: the want row's first full bar is left of ready's.
    assert rows["want"].index(BARS[7]) < rows["ready"].index(BARS[7])
    assert "/ 2.0s" in rows["TTFT"] and "/ 50ms" in rows["ITL"]


def test_ttft_over_its_target_is_red() -> None:
    state, _ = make_state()
    for i, ttft in enumerate((500.0, 2500.0, 900.0), start=1):
        state.apply_discovery(planner_status_key(NS), live_status(i, ttft=ttft))
    (p,) = state.scaling_pools()
    plot = scaling_plot(p, 80)
    assert plot is not None
    ttft_row = next(line for line in plot.renderables if str(line).startswith("TTFT"))
    bars = [(ttft_row.plain[span.start:span.end], str(span.style)) for span in ttft_row.spans
            if ttft_row.plain[span.start:span.end].strip() and ttft_row.plain[span.start:span.end] in BARS]
    assert [style for _, style in bars] == ["green", "bold red", "green"]


async def test_scaling_view_plot_at_80x24() -> None:
    """Pilot at 80x24 on the recorded run: the plot is drawn under the pool's facts, every row in
    80 columns, and the decisions table still has room below it."""
    app = ConsoleApp(replay(read_records(SCALING_RECORDING)), initial_view="scaling")
    async with app.run_test(size=(80, 24)) as pilot:
        chart = app.query_one("#scaling-plot", Static)
        await until(pilot, lambda: chart.display and chart.size.height >= 7, what="the plot")
        assert chart.region.bottom <= 24 - 3  # decisions header + a row + the footer still show
        lines = [chart.render_line(y).text.strip() for y in range(chart.size.height)]
        assert [line.split()[0] for line in lines[1:]] == ["want", "ready", "req/s", "queue", "TTFT", "ITL"], lines
        assert chart.region.right <= 80
        decisions = app.query_one("#scaling-decisions")
        assert decisions.region.height >= 2 and decisions.region.bottom <= 23, decisions.region
