"""Scaling in the console and dynamoctl: the state manager fed typed planner decisions, status and
overrides; decisions and records arriving through the real collectors (a real event-plane
publisher, a real store's watch); ``dynamoctl planner status|decisions`` and ``dynamoctl scale``
against real etcd and file discovery; and the Scaling view and its scale keys driven by Pilot."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from textual.widgets import DataTable, Input

from dynamod.console.actions.scaling import ScaleClient
from dynamod.console.ctl.main import main as dynamoctl
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import RecordingSink, apply_record, read_records, replay
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.screens import ConfirmScreen, ScaleScreen
from dynamod.console.tui.views.scaling import ScalingView
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.events.plane import TOPIC_PLANNER_DECISIONS
from dynamod.shared.protocol.keys import planner_override_key, planner_status_key
from dynamod.shared.protocol.planner import (
    PLANNER_COMPONENT,
    PlannerDecision,
    PlannerStatus,
    PoolStatus,
    ScaleOverride,
    decision_encoder,
)
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.console.factories import NAMESPACE, make_state, register
from tests.console.live import collecting
from tests.console.pilot import until

NS = NAMESPACE


def decision(decision_id: int, pool: str = "decode", current: int = 2, desired: int = 2, *, reason: str = "sla_throughput",
             ts: float = 1000.0, **kw: object) -> PlannerDecision:
    action = "hold" if desired == current else ("scale_up" if desired > current else "scale_down")
    return PlannerDecision(decision_id=decision_id, ts=ts, namespace=NS, planner="sla", pool=pool,
                           component="prefill" if pool == "prefill" else "backend", current=current, desired=desired,
                           action=action, reason=reason, **kw)  # type: ignore[arg-type]


def status(**pools: tuple[int, int]) -> PlannerStatus:
    return PlannerStatus(namespace=NS, planner="sla", connector="virtual", interval_s=1.0,
                         targets={"ttft_ms": 200.0, "itl_ms": 10.0},
                         pools={p: PoolStatus(component="prefill" if p == "prefill" else "backend", current=c, desired=d,
                                              min_replicas=1, max_replicas=4) for p, (c, d) in pools.items()})


# -- the state manager ------------------------------------------------------------------------------


def test_pool_joins_workers_status_decisions_and_override() -> None:
    state, clock = make_state()
    register(state, 0x1, role="decode")
    register(state, 0x2, role="decode", status="draining")
    register(state, 0x3, role="prefill")
    state.apply_discovery(planner_status_key(NS), status(decode=(2, 3), prefill=(1, 1)))
    state.apply_planner_decision(NS, decision(1, current=2, desired=2, ts=clock() - 2,
                                              predicted={"request_rate": 4.0, "isl": 3000.0, "osl": 150.0},
                                              targets={"ttft_ms": 200.0, "itl_ms": 10.0}, inputs={"itl_ms": 12.0}))
    state.apply_planner_decision(NS, decision(2, current=2, desired=3, ts=clock() - 1, reason="sla_throughput",
                                              detail="ITL over target", targets={"ttft_ms": 200.0, "itl_ms": 10.0},
                                              inputs={"itl_ms": 12.0}))
    state.apply_discovery(planner_override_key(NS, "decode"), ScaleOverride(replicas=5, set_by="ops@host", reason="launch"))

    pools = {p.pool: p for p in state.scaling_pools()}
    assert [p.pool for p in state.scaling_pools()] == ["prefill", "decode"]
    decode = pools["decode"]
    assert (decode.ready, decode.live) == (1, 2)  # the draining worker counts as live, not ready
    assert (decode.current, decode.desired, decode.min_replicas, decode.max_replicas) == (2, 3, 1, 4)
    assert decode.override is not None and decode.override.replicas == 5 and decode.target == 5
    assert [d.decision_id for d in decode.decisions] == [2, 1]  # newest first
    assert decode.planner == "sla" and decode.targets["itl_ms"] == 10.0
    assert decode.itl_ms == 12.0  # no frontend figures yet: the planner's own observation stands in
    assert pools["prefill"].ready == 1 and pools["prefill"].decisions == []

    scaling = [e.message for e in state.recent_events(kinds=["scaling"])]
    assert any("scale up 2 -> 3" in m for m in scaling)
    assert any("override ns/decode = 5 by ops@host: launch" in m for m in scaling)
    assert not any("stays" in m for m in scaling), "holds are listed in the view, not logged as events"


def test_status_and_override_deletes_and_reconcile() -> None:
    state, _ = make_state()
    register(state, 0x1, role="agg")
    state.apply_discovery(planner_status_key(NS), status(agg=(1, 1)))
    state.apply_discovery(planner_override_key(NS, "agg"), ScaleOverride(replicas=3))
    version = state.versions.scaling
    state.reconcile_planner({planner_status_key(NS): status(agg=(1, 2))})  # the override vanished meanwhile
    assert state.versions.scaling > version
    (agg,) = state.scaling_pools()
    assert agg.override is None and agg.desired == 2
    state.apply_discovery(planner_status_key(NS), None)
    (agg,) = state.scaling_pools()
    assert agg.planner == "" and agg.desired is None
    messages = [e.message for e in state.recent_events(kinds=["scaling"])]
    assert any("override ns/agg cleared" in m for m in messages)
    assert any("planner for ns gone" in m for m in messages)


def test_recording_round_trip_and_old_shape(tmp_path: Path) -> None:
    """Typed decisions and planner records survive record -> replay; a decision of the old untyped
    shape replays as a decode error instead of stopping the replay."""
    lines: list[str] = []
    live, _ = make_state()
    sink = RecordingSink(live, lines.append)
    sink.reconcile_planner({planner_status_key(NS): status(decode=(1, 2))})
    sink.apply_planner_decision(NS, decision(7, current=1, desired=2))
    sink.apply_discovery(planner_override_key(NS, "decode"), ScaleOverride(replicas=4))
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(lines))
    replayed = replay(read_records(path))
    (p,) = replayed.scaling_pools()
    assert (p.desired, p.override.replicas if p.override else None, [d.decision_id for d in p.decisions]) == (2, 4, [7])

    old, _ = make_state()
    apply_record(old, {"t": 1.0, "kind": "planner_decision", "namespace": NS,
                       "value": {"component": "prefill", "from": 2, "to": 1, "reason": "queue empty"}})
    assert old.counters["decode_errors"] == 1 and old.scaling_pools() == []


def test_recorded_clusters_have_scaling(recorded_state: ClusterState, disagg_state: ClusterState) -> None:
    agg = next(p for p in recorded_state.scaling_pools() if p.pool == "agg")
    assert agg.override is not None and agg.override.set_by == "ops@bastion"
    assert agg.last is not None and agg.last.reason == "override"
    decode = next(p for p in disagg_state.scaling_pools() if p.pool == "decode")
    assert decode.predicted["request_rate"] > 0 and decode.targets["itl_ms"] == 7.0
    assert decode.measured.itl_p50 is not None and decode.itl_ms > decode.targets["itl_ms"]  # over target
    (router,) = disagg_state.global_routers()
    assert router.pools == ["dynamo", "dynamo-large"] and router.ready["dynamo-large"] == 0


# -- collectors: a real publisher, a real store's watch ---------------------------------------------


def _file_settings(root: Path) -> RuntimeSettings:
    s = RuntimeSettings()
    s.namespace = NS
    s.discovery_backend = "file"
    s.file_kv = str(root)
    s.event_plane = "zmq"
    s.system_port = None
    return s.validate()


async def test_console_collects_decisions_status_and_overrides(tmp_path: Path) -> None:
    """A planner-like process publishes typed decisions on the real event plane and writes its
    status; an operator writes an override: the console's collectors put all three in the state."""
    planner = await DistributedRuntime.create(_file_settings(tmp_path), events=True)
    try:
        async with collecting(tmp_path, NS) as state:
            pub = await planner.namespace(NS).component(PLANNER_COMPONENT).publisher(TOPIC_PLANNER_DECISIONS)
            await planner.store.put(planner_status_key(NS), msgspec.json.encode(status(decode=(1, 2))))
            await ScaleClient(planner.store, set_by="test").set_override(NS, "decode", 3, reason="why not")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while not state.scaling.decisions(NS, "decode"):
                assert loop.time() < deadline, "no planner decision reached the console"
                await pub.publish(TOPIC_PLANNER_DECISIONS, decision_encoder.encode(decision(9, current=1, desired=2)))
                await asyncio.sleep(0.1)
            while not (state.scaling_pools() and state.scaling_pools()[0].override is not None):
                assert loop.time() < deadline, "status/override never reached the console"
                await asyncio.sleep(0.05)
            (p,) = state.scaling_pools()
            assert (p.desired, p.override.replicas if p.override else None, p.decisions[0].decision_id) == (2, 3, 9)
            assert p.override is not None and p.override.set_by == "test" and p.override.reason == "why not"
            # Garbage on the topic is counted, not fatal.
            await pub.publish(TOPIC_PLANNER_DECISIONS, b"\x81\xa3foo\x01")
            while state.counters["decode_errors"] == 0:
                assert loop.time() < deadline, "an unreadable decision was not reported"
                await asyncio.sleep(0.05)
    finally:
        await planner.shutdown(grace_s=0.0)


# -- dynamoctl --------------------------------------------------------------------------------------


def _ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = dynamoctl(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


async def _put_status(store_args: dict, value: PlannerStatus) -> None:
    store = make_store(**store_args)
    await store.start()
    try:
        await store.put(planner_status_key(NS), msgspec.json.encode(value))
    finally:
        await store.close()


async def _read(store_args: dict, key: str) -> bytes | None:
    store = make_store(**store_args)
    await store.start()
    try:
        return await store.get(key)
    finally:
        await store.close()


def test_dynamoctl_scale_and_status_against_etcd(etcd_server, capsys: pytest.CaptureFixture[str]) -> None:
    store_args = {"backend": "etcd", "etcd_endpoints": [etcd_server.endpoint]}
    asyncio.run(_put_status(store_args, status(prefill=(1, 1), decode=(2, 3))))
    conn = ("--discovery", "etcd", "--etcd", etcd_server.endpoint, "--namespace", NS)

    rc, out, err = _ctl(capsys, "scale", "decode", "4", *conn, "--reason", "launch day")
    assert rc == 0 and "ns/decode held at 4" in out and not err
    override = msgspec.json.decode(asyncio.run(_read(store_args, planner_override_key(NS, "decode"))) or b"", type=ScaleOverride)
    assert override.replicas == 4 and override.reason == "launch day" and "@" in override.set_by

    rc, out, _ = _ctl(capsys, "planner", "status", *conn)
    assert rc == 0
    decode_line = next(line for line in out.splitlines() if line.startswith("ns/decode"))
    assert decode_line.split()[1:5] == ["sla", "0/0", "3", "4"]  # planner, ready/live, want, override
    assert "override ns/decode = 4" in out

    rc, out, _ = _ctl(capsys, "planner", "status", "--json", *conn)
    doc = json.loads(out)
    pools = {p["pool"]: p for p in doc["pools"]}
    assert pools["decode"]["override"]["replicas"] == 4 and pools["decode"]["target"] == 4
    assert doc["planners"][0]["planner"] == "sla"

    for argv, words in ((("scale", "prefil", "2"), "unknown pool 'prefil'"), (("scale", "decode", "-1"), "0 or more"),
                        (("scale", "agg", "1"), "no agg pool"), (("scale", "decode", "two"), "whole number"),
                        (("scale", "decode"), "give the replicas")):
        rc, out, err = _ctl(capsys, *argv, *conn)
        assert rc != 0 and words in err and len(err.strip().splitlines()) == 1, (argv, err)

    rc, out, _ = _ctl(capsys, "scale", "decode", "--clear", *conn)
    assert rc == 0 and "cleared" in out
    assert asyncio.run(_read(store_args, planner_override_key(NS, "decode"))) is None


async def test_dynamoctl_planner_decisions_from_a_real_publisher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``planner decisions --limit 2 --json`` against file discovery and ZMQ: prints the decisions a
    real publisher sends, as JSON lines, and stops after two."""
    planner = await DistributedRuntime.create(_file_settings(tmp_path), events=True)
    try:
        await planner.store.put(planner_status_key(NS), msgspec.json.encode(status(decode=(1, 2))))
        pub = await planner.namespace(NS).component(PLANNER_COMPONENT).publisher(TOPIC_PLANNER_DECISIONS)
        argv = ["planner", "decisions", "--json", "--limit", "2", "--wait", "30",
                "--discovery", "file", "--file-kv", str(tmp_path), "--namespace", NS]
        ctl = asyncio.create_task(asyncio.to_thread(dynamoctl, argv))
        n = 0
        while not ctl.done():
            n += 1
            await pub.publish(TOPIC_PLANNER_DECISIONS, decision_encoder.encode(decision(n, reason="kv_usage_high")))
            await asyncio.sleep(0.1)
        assert await ctl == 0
    finally:
        await planner.shutdown(grace_s=0.0)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    got = [msgspec.json.decode(line, type=PlannerDecision) for line in out]
    assert all(d.reason == "kv_usage_high" and d.pool == "decode" for d in got)
    assert got[0].decision_id < got[1].decision_id


def test_dynamoctl_decisions_gives_up_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _ctl(capsys, "planner", "decisions", "--wait", "0.5", "--discovery", "file", "--file-kv", str(tmp_path))
    assert rc == 1 and not out and len(err.strip().splitlines()) == 1 and "no planner decision" in err


# -- the Scaling view and its keys ------------------------------------------------------------------

SIZE = (100, 30)


async def _store_with_status(state: ClusterState) -> MemStore:
    """A real store holding the recorded planner's status: what the scale action validates against."""
    store = MemStore()
    await store.start()
    for ns, st in state.scaling.statuses.items():
        await store.put(planner_status_key(ns), msgspec.json.encode(st))
    return store


async def _scaling_app(state: ClusterState, store: MemStore | None, **kw: object) -> ConsoleApp:
    client = ScaleClient(store, set_by="pilot") if store is not None else None
    return ConsoleApp(state, initial_view="scaling", scale_factory=lambda: client, **kw)  # type: ignore[arg-type]


async def _wait_for_key(pilot, store: MemStore, key: str, *, present: bool = True, timeout: float = 10.0) -> bytes | None:
    """Lets the app run until ``key`` is (or is no longer) in the store."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await store.get(key)
        if (value is not None) == present:
            return value
        assert loop.time() < deadline, f"{key} {'never written' if present else 'never deleted'}"
        await pilot.pause(0.05)


async def _select_pool(pilot, key: str) -> None:
    table = pilot.app.query_one("#scaling-pools", DataTable)
    keys = [r.key.value for r in table.ordered_rows]
    table.move_cursor(row=keys.index(key))
    await pilot.pause()


async def test_scaling_view_shows_pools_decisions_and_routers(disagg_state: ClusterState) -> None:
    app = await _scaling_app(disagg_state, None)
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ScalingView)
        table = app.query_one("#scaling-pools", DataTable)
        assert [r.key.value for r in table.ordered_rows] == ["dynamo/prefill", "dynamo/decode"]
        await _select_pool(pilot, "dynamo/decode")
        assert str(table.get_cell("dynamo/decode", "WANT")) == "4"
        decisions = app.query_one("#scaling-decisions", DataTable)
        assert str(decisions.get_cell("0", "ACTION")) == "scale_up"  # newest first
        assert str(decisions.get_cell("0", "SIZE")) == "3->4"
        selected = view.selected_pool()
        assert selected is not None and selected.key == "dynamo/decode"
        await pilot.press("slash")
        for ch in "prefill":
            await pilot.press(ch)
        await until(pilot, lambda: table.row_count == 1, what="the filter")
        await pilot.press("escape", "escape")
        # `:` jumps here, the digit too.
        await pilot.press("2")
        assert app.current_view == "workers"
        await pilot.press("6")
        assert app.current_view == "scaling"


@asynccontextmanager
async def _scale_dialog(state: ClusterState, pool_key: str) -> AsyncIterator[tuple[ConsoleApp, Any, MemStore]]:
    """The Scaling view with ``pool_key`` selected and its scale dialog open; yields the app, its
    pilot and the store the overrides are written to."""
    store = await _store_with_status(state)
    app = await _scaling_app(state, store)
    async with app.run_test(size=SIZE) as pilot:
        await _select_pool(pilot, pool_key)
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, ScaleScreen), what="the scale dialog")
        yield app, pilot, store


async def test_scale_down_asks_then_writes_the_override(disagg_state: ClusterState) -> None:
    async with _scale_dialog(disagg_state, "dynamo/decode") as (app, pilot, store):
        await pilot.press("1", "enter")
        await pilot.press(*"night", "enter")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirm dialog")
        assert "down to 1" in str(app.screen.question)
        await pilot.press("y")
        raw = await _wait_for_key(pilot, store, planner_override_key("dynamo", "decode"))
        o = msgspec.json.decode(raw, type=ScaleOverride)
        assert (o.replicas, o.reason, o.set_by) == (1, "night", "pilot")
        await until(pilot, lambda: any(e.kind == "action" and "held at 1" in e.message for e in disagg_state.recent_events()),
                    what="the action result")


async def test_scale_up_needs_no_confirm_and_clear_does(disagg_state: ClusterState) -> None:
    key = planner_override_key("dynamo", "prefill")
    async with _scale_dialog(disagg_state, "dynamo/prefill") as (app, pilot, store):
        app.screen.query_one("#scale-replicas", Input).value = "3"
        app.screen.query_one("#scale-reason", Input).value = "burst"
        await pilot.press("enter")
        await until(pilot, lambda: not isinstance(app.screen, ScaleScreen), what="the dialog to close")
        assert not isinstance(app.screen, ConfirmScreen)

        raw = await _wait_for_key(pilot, store, key)
        # The console's own state learns of it from discovery (no watch here): fed as the watch would.
        disagg_state.apply_discovery(key, msgspec.json.decode(raw or b"", type=ScaleOverride))
        view = app.query_one(ScalingView)
        await until(pilot, lambda: (p := view.selected_pool()) is not None and p.override is not None, what="the override shown")
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the clear confirm")
        await pilot.press("y")
        await _wait_for_key(pilot, store, key, present=False)


async def test_bad_replicas_stay_in_the_dialog(disagg_state: ClusterState) -> None:
    async with _scale_dialog(disagg_state, "dynamo/decode") as (app, pilot, store):
        app.screen.query_one("#scale-replicas", Input).value = "-2"
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ScaleScreen)
        assert "0 or more" in str(app.screen.query_one("#scale-error").render())
        await pilot.press("escape")
        assert await store.get(planner_override_key("dynamo", "decode")) is None


async def test_read_only_blocks_scaling(disagg_state: ClusterState) -> None:
    store = await _store_with_status(disagg_state)
    app = await _scaling_app(disagg_state, store, read_only=True)
    async with app.run_test(size=SIZE) as pilot:
        await _select_pool(pilot, "dynamo/decode")
        await pilot.press("r", "x")
        await pilot.pause()
        assert not isinstance(app.screen, ScaleScreen | ConfirmScreen)
        app.start_pool_action("scale")  # the palette's path is refused too
        await pilot.pause()
        assert not isinstance(app.screen, ScaleScreen)
        assert await store.get(planner_override_key("dynamo", "decode")) is None
