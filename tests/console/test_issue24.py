"""Issue 24's console items on the recorded cluster at 80x24 (Pilot), and the state they read:

- 6: a worker ``dynamod up`` gave up on shows as ``failed`` with its last death (Workers, Topology,
  ``dynamoctl status --json``), Enter opens its record;
- 10: a frontend whose ``/metrics`` refused the console says so where the figures would be;
- 11: cached blocks seeded from ``kv_dump``, with the events that raced the dump on top;
- 12: the slow-worker alert compares local prefills with local ones, remote with remote;
- 13: Enter opens the full text of an event, a routing decision, a pool; ``s`` means Sleep only;
- 18: the topology lists workers with their endpoints on one line;
- issue 25 item 7: network strings with escape sequences are drawn as visible escapes.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
from rich.console import Console
from textual.widgets import DataTable, Static, Tree

from dynamod.console.actions.control import ActionResult
from dynamod.console.actions.specs import ACTIONS, POOL_ACTIONS, check_unique_keys
from dynamod.console.ctl.commands import _report
from dynamod.console.present import format_table, status_records
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.imbalance import detect_imbalances
from dynamod.console.state.prom import parse_frontend_metrics
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.screens import DetailScreen, HelpScreen, ScaleScreen, SleepLevelScreen
from dynamod.console.tui.views.scaling import ScalingView
from dynamod.shared.protocol import control
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.protocol.supervisor import FailedWorker, failed_key
from tests.console.factories import make_state, register
from tests.console.fixtures.make_recording import FRONTEND_URL, WORKER_A, WORKER_B
from tests.console.pilot import cursor_to_worker, until, workers_table

SIZE = (80, 24)
ESCAPE = "\x1b]0;owned\x07\x1b[2J"


def _text(renderable: object, width: int = 80) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


def _fail(state: ClusterState, name: str = "worker-3", reason: str = "exit code 1") -> None:
    state.apply_discovery(failed_key("dynamo", name), FailedWorker(
        name=name, pool="agg", reason=reason, crashes=5, window_s=60.0, log=f"/tmp/logs/{name}.log",
        ts=state.clock() - 30))


# -- item 6: failed workers -------------------------------------------------------------------------


async def test_a_failed_worker_is_a_row_a_banner_and_a_detail(recorded_state: ClusterState) -> None:
    _fail(recorded_state, reason="killed by SIGKILL")
    app = ConsoleApp(recorded_state, initial_view="workers")
    async with app.run_test(size=SIZE) as pilot:
        table = workers_table(app)
        key = "failed/dynamo/worker-3"
        await until(pilot, lambda: key in [r.key.value for r in table.ordered_rows], what="the failed row")
        assert str(table.get_cell(key, "STATUS")) == "failed" and str(table.get_cell(key, "ID")) == "worker-3"
        banner = str(app.query_one("#failed", Static).render())
        assert banner == "✗ worker-3: killed by SIGKILL (5 deaths in 60s); dynamoctl restart worker-3"
        table.move_cursor(row=table.get_row_index(key))
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        body = _text(app.screen.body)
        assert "killed by SIGKILL" in body and "/tmp/logs/worker-3.log" in body and "dynamoctl restart worker-3" in body
        await pilot.press("escape", "1")
        tree = app.query_one("#topology", Tree)
        labels = [str(n.label) for n in tree._tree_nodes.values()]
        assert any(label.startswith("worker-3  failed  killed by SIGKILL") for label in labels), labels
    # The restart clears it, and the event log tells both.
    recorded_state.apply_discovery(failed_key("dynamo", "worker-3"), None)
    assert recorded_state.failed() == []
    messages = [e.message for e in recorded_state.recent_events(limit=5)]
    assert any("worker-3 is no longer failed" in m for m in messages)
    assert any("worker-3 failed: killed by SIGKILL" in m for m in messages)


def test_failed_workers_are_in_status_json(recorded_state: ClusterState) -> None:
    _fail(recorded_state)
    records = status_records(recorded_state)
    failed = [r for r in records if r["status"] == "failed"]
    assert len(failed) == 1
    f = failed[0]
    assert (f["id"], f["name"], f["namespace"], f["role"]) == (None, "worker-3", "dynamo", "agg")
    assert f["failed"]["reason"] == "exit code 1" and f["failed"]["restart"] == "dynamoctl restart worker-3"
    assert set(f) >= set(records[0])  # the keys every record has, so scripts iterate safely
    json.dumps(records)


# -- item 10: why a figure is missing ---------------------------------------------------------------


async def test_a_refused_scrape_says_why_in_models_and_workers(recorded_state: ClusterState) -> None:
    reason = f"401 from {FRONTEND_URL}: the frontend wants a key; give --api-key-file (or DYN_API_KEY)"
    recorded_state.scrape_failed(FRONTEND_URL, reason)
    assert recorded_state.metric_problems() == [reason]
    assert all(m.stats.request_rate is None for m in recorded_state.models().values())  # its figures are gone
    app = ConsoleApp(recorded_state, initial_view="models")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        shown = app.query_one("#models-problems", Static)
        assert str(shown.render()) == f"⚠ no figures: {reason}"
        assert shown.size.height == 2  # wrapped, the flag that fixes it on screen
        await pilot.press("2")
        line = app.query_one("#metrics-problem", Static)
        assert str(line.render()).startswith("⚠ no TTFT/ITL: 401 from") and "--api-key-file" in str(line.render())
        assert line.size.height == 2
    recorded_state.apply_metrics_text(FRONTEND_URL, "# TYPE x gauge\nx 1\n")  # it answers again
    assert recorded_state.metric_problems() == []


# -- item 11: cached blocks from kv_dump ------------------------------------------------------------


def _stored(wid: int, eid: int, n: int) -> RouterEvent:
    blocks = [StoredBlock(block_hash=eid * 100 + i, tokens_hash=eid * 100 + i) for i in range(n)]
    return RouterEvent(worker_id=wid, event_id=eid, event=KvStored(parent_hash=None, blocks=blocks))


def test_a_kv_dump_seeds_the_count_and_racing_events_land_on_top() -> None:
    state, _ = make_state()
    register(state, 0x11)
    st = state.find_worker(0x11).stats
    state.apply_kv_event(_stored(0x11, 40, 2))  # published before the dump: already in it
    state.apply_kv_event(_stored(0x11, 42, 3))  # after it
    state.apply_kv_event(RouterEvent(worker_id=0x11, event_id=43, event=KvRemoved(block_hashes=[1])))
    assert st.cached_blocks == 4  # what the events alone say: far from the worker's 500
    state.apply_kv_seed(0x11, 500, 41)
    assert (st.cached_blocks, st.kv_seeded) == (502, True)
    state.apply_kv_event(_stored(0x11, 44, 1))
    assert st.cached_blocks == 503
    # A gap in event ids: the count is re-read; a clear after the dump wins over it.
    state.apply_kv_event(_stored(0x11, 50, 1))
    assert st.kv_seeded is False
    state.apply_kv_event(RouterEvent(worker_id=0x11, event_id=51, event=KvCleared()))
    state.apply_kv_seed(0x11, 300, 49)
    assert st.cached_blocks == 0


# -- item 12: like with like ------------------------------------------------------------------------


METRICS = """# TYPE dynamo_frontend_worker_last_time_to_first_token_seconds gauge
dynamo_frontend_worker_last_time_to_first_token_seconds{worker_id="%016x",prefill="local"} 0.498
dynamo_frontend_worker_last_time_to_first_token_seconds{worker_id="%016x",prefill="remote"} 0.020
dynamo_frontend_worker_last_time_to_first_token_seconds{worker_id="%016x",prefill="remote"} 0.021
dynamo_frontend_worker_last_time_to_first_token_seconds{worker_id="%016x",prefill="remote"} 0.019
"""


def test_a_local_prefill_is_not_compared_with_remote_ones() -> None:
    """Decode worker 0x11 prefilled one long prompt itself (conditional disaggregation): 498 ms
    beside its peers' remote-prefill 20 ms is two populations, not a slow worker."""
    state, clock = make_state()
    for iid in (0x11, 0x22, 0x33):
        register(state, iid, role="decode")
        state.apply_load(_load(iid))
    scrape = parse_frontend_metrics(METRICS % (0x11, 0x11, 0x22, 0x33))
    assert scrape.worker_ttft_by[(0x11, "local")] == 0.498 and scrape.worker_ttft[0x11] == 0.020
    state.apply_scrape("http://f/metrics", scrape)
    assert [i for i in detect_imbalances(state.worker_list()) if i.kind == "slow"] == []
    # A second local-prefill figure to compare with: now 0x11 is slow among local prefills.
    extra = f'dynamo_frontend_worker_last_time_to_first_token_seconds{{worker_id="{0x22:016x}",prefill="local"}} 0.09\n'
    state.apply_metrics_text("http://f/metrics", METRICS % (0x11, 0x11, 0x22, 0x33) + extra)
    slow = [i.message for i in detect_imbalances(state.worker_list(), clock.now) if i.kind == "slow"]
    assert slow == ["slow worker 0000000000000011: TTFT (local prefill) 498 ms vs peers 90 ms"]
    # Nothing new for two minutes: the 498 ms is an old request's, and the alert does not stay.
    clock.advance(121)
    state.apply_metrics_text("http://f/metrics", METRICS % (0x11, 0x11, 0x22, 0x33) + extra)
    assert [i for i in detect_imbalances(state.worker_list(), clock.now) if i.kind == "slow"] == []


def _load(iid: int):
    from dynamod.shared.protocol.load import LoadMetrics

    return LoadMetrics(worker_id=iid, dp_rank=0, kv_usage=0.3, num_running=1, num_waiting=0, total_blocks=100)


# -- item 13: detail panes, one meaning per key -----------------------------------------------------


async def test_enter_opens_the_full_text_of_an_event(recorded_state: ClusterState) -> None:
    app = ConsoleApp(recorded_state, initial_view="events")
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one("#events", DataTable)
        index = next(i for i, e in enumerate(recorded_state.recent_events(limit=500)) if "node=" in e.message)
        full = recorded_state.recent_events(limit=500)[index].message
        assert "…" in str(table.get_cell(str(index), "MESSAGE"))  # cut at 80 columns
        table.move_cursor(row=index)
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        assert full in _text(app.screen.body)
        await pilot.press("escape")
        assert app.current_view == "events" and len(app.screen_stack) == 1


async def test_enter_opens_a_routing_decision_then_its_worker(recorded_state: ClusterState) -> None:
    app = ConsoleApp(recorded_state, initial_view="router")
    async with app.run_test(size=SIZE) as pilot:
        newest = recorded_state.decisions[-1]
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        body = _text(app.screen.body)
        assert newest.explanation() in body.replace("\n", " ") or newest.explanation()[:60] in body
        assert "candidates" in body
        await pilot.press("enter")
        await pilot.pause()
        from dynamod.console.tui.screens import WorkerScreen

        assert isinstance(app.screen, WorkerScreen) and app.screen.instance_id == newest.worker_id


async def test_enter_on_a_pool_shows_every_decision_in_full(disagg_state: ClusterState) -> None:
    app = ConsoleApp(disagg_state, initial_view="scaling")
    async with app.run_test(size=SIZE) as pilot:
        view = app.query_one(ScalingView)
        await until(pilot, lambda: view.selected_pool() is not None, what="a pool")
        pool = view.selected_pool()
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        body = _text(app.screen.body, width=200)
        for d in pool.decisions:
            if d.detail:
                assert d.detail in body


async def test_s_is_sleep_in_every_view_and_r_scales_a_pool(recorded_state: ClusterState) -> None:
    check_unique_keys()
    keys = [a.key for a in ACTIONS] + [p.key for p in POOL_ACTIONS]
    assert len(keys) == len(set(keys)) and "s" not in [p.key for p in POOL_ACTIONS]
    app = ConsoleApp(recorded_state, initial_view="scaling")
    async with app.run_test(size=SIZE) as pilot:
        view = app.query_one(ScalingView)
        await until(pilot, lambda: view.selected_pool() is not None, what="a pool")
        await pilot.press("s")
        await pilot.pause()
        assert not isinstance(app.screen, ScaleScreen)
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, ScaleScreen), what="the scale dialog")
        await pilot.press("escape", "2")
        await cursor_to_worker(pilot, WORKER_A)
        await pilot.press("s")
        assert isinstance(app.screen, SleepLevelScreen)
        await pilot.press("escape", "question_mark")
        assert isinstance(app.screen, HelpScreen)


# -- item 18: topology ------------------------------------------------------------------------------


async def test_topology_is_pools_and_workers_with_endpoints_on_one_line(recorded_state: ClusterState) -> None:
    app = ConsoleApp(recorded_state, initial_view="topology")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        tree = app.query_one("#topology", Tree)
        labels = [str(n.label) for n in tree._tree_nodes.values() if n is not tree.root]
        assert not any(label.startswith(("clear_kv_blocks", "kv_dump", "drain (")) for label in labels), labels
        pools = [label for label in labels if " pool" in label]
        assert pools[0].startswith("agg pool · backend (4: 2 ready, 1 draining, 1 sleeping)")
        endpoint_lines = [label for label in labels if label.startswith("endpoints:")]
        assert len(endpoint_lines) == len(recorded_state.worker_list(workers_only=False))
        # The recording predates the traces endpoint (issue 30): its workers serve the other controls.
        controls = len(control.CONTROL_ENDPOINTS)
        assert f"endpoints: generate, {controls - 1}/{controls} control (no traces)" in endpoint_lines
        # Every worker is on the first 80x24 screen.
        assert len(labels) <= 21


# -- issue 25 item 7: network strings -------------------------------------------------------------


def test_dynamoctl_prints_escapes_as_text() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        _report(ActionResult("lora load", "00000000000000aa", True, f"loaded sql{ESCAPE}"), as_json=False)
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    assert "loaded sql\\x1b]0;owned\\x07\\x1b[2J" in out.getvalue()
    table = format_table(("INSTANCE", "NAME", "SOURCE"), [("aa", f"evil{ESCAPE}", "/a\r/b")])
    assert "\x1b" not in table and "\r" not in table and "evil\\x1b" in table and "/a\\x0d/b" in table


async def test_the_console_draws_escapes_as_text(recorded_state: ClusterState) -> None:
    """A LoRA and a model name with escape sequences and markup: drawn as typed, never obeyed."""
    recorded_state.put_card(mdc_key("dynamo", "backend", "generate", WORKER_B, f"x{ESCAPE}"),
                            ModelCard(served_model_name=f"x{ESCAPE}", lora=f"x{ESCAPE}", base_model="tiny"))
    app = ConsoleApp(recorded_state, initial_view="models")
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause()
        table = app.query_one("#models-table", DataTable)
        names = [str(table.get_cell(r.key, "MODEL")) for r in table.ordered_rows]
        assert any(n.startswith("x\\x1b]0;owned\\x07") for n in names), names
        assert not any("\x1b" in n for n in names)
        await pilot.press("2")
        await cursor_to_worker(pilot, WORKER_B)
        loras = str(workers_table(app).get_cell(f"dynamo/backend/{WORKER_B:016x}", "LORAS"))
        assert "\x1b" not in loras and "x\\x1b" in loras


@pytest.mark.parametrize("view", ["workers", "topology"])
def test_failed_worker_snapshot(snap_compare, recording, view: str) -> None:
    """80x24: the failed worker's row and banner (Workers), its leaf under its pool (Topology)."""
    from dynamod.console.state.recording import replay

    state = replay(recording)
    _fail(state, reason="killed by SIGKILL")
    assert snap_compare(ConsoleApp(state, initial_view=view), terminal_size=SIZE)


def test_event_detail_snapshot(snap_compare, recording) -> None:
    from dynamod.console.state.recording import replay

    state = replay(recording)
    index = next(i for i, e in enumerate(state.recent_events(limit=500)) if "node=" in e.message)

    async def run_before(pilot) -> None:
        pilot.app.query_one("#events", DataTable).move_cursor(row=index)
        await pilot.press("enter")
        await pilot.pause()

    assert snap_compare(ConsoleApp(state, initial_view="events"), run_before=run_before, terminal_size=SIZE)


async def test_the_discovery_collector_follows_failed_records() -> None:
    """The supervisor's records reach the state by listing and by watch; restart requests do not."""
    import asyncio

    import msgspec

    from dynamod.console.collectors.discovery import DiscoveryCollector
    from dynamod.shared.discovery.mem import MemStore
    from dynamod.shared.protocol.supervisor import restart_key

    store = MemStore()
    await store.start()
    key = failed_key("dynamo", "worker-1")
    await store.put(key, msgspec.json.encode(FailedWorker(name="worker-1", pool="decode", reason="exit code 2")))
    state, _ = make_state()
    changed = asyncio.Event()
    state.add_event_listener(lambda _ev: changed.set())  # a failure and a restart are events
    task = asyncio.create_task(DiscoveryCollector(store, state).run())
    try:
        async def until_state(predicate) -> None:
            async with asyncio.timeout(5):
                while not predicate():
                    await changed.wait()
                    changed.clear()

        await until_state(lambda: [f.name for f in state.failed()] == ["worker-1"])
        await store.put(restart_key("dynamo", "worker-1"), b'{"name": "worker-1"}')
        await store.put(failed_key("dynamo", "worker-2"), msgspec.json.encode(FailedWorker(name="worker-2")))
        await until_state(lambda: [f.name for f in state.failed()] == ["worker-1", "worker-2"])
        await store.delete(restart_key("dynamo", "worker-1"))
        await store.delete(key)
        await until_state(lambda: [f.name for f in state.failed()] == ["worker-2"])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()
