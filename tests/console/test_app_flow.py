"""Pilot tests of the console's keyboard flow on a recorded cluster: navigation (``:``, ``/``,
Enter, Esc, ``?``), every action's prompt/confirm/result path, read-only mode, the palette.

The cluster side of each action is covered live in tests/integration/test_console_live.py."""

from __future__ import annotations

from textual.command import CommandList, CommandPalette
from textual.widgets import DataTable, Input

from dynamod.console.state.cluster import ClusterState
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.screens import (
    ConfirmScreen,
    HelpScreen,
    LoraLoadScreen,
    LoraUnloadScreen,
    SleepLevelScreen,
    WorkerScreen,
)
from tests.console.fakes import FakeControl
from tests.console.fixtures.make_recording import WORKER_A, WORKER_B

SIZE = (100, 30)


def _app(state: ClusterState, control: FakeControl | None = None, **kw) -> ConsoleApp:
    fake = control or FakeControl()
    return ConsoleApp(state, control_factory=lambda: fake, **kw)


def _table(app: ConsoleApp) -> DataTable:
    return app.query_one("#workers-table", DataTable)


def _row_keys(table: DataTable) -> list[str]:
    return [r.key.value for r in table.ordered_rows]


async def _select(app: ConsoleApp, pilot, iid: int) -> None:
    table = _table(app)
    index = next(i for i, k in enumerate(_row_keys(table)) if k.endswith(f"/{iid:x}"))
    table.move_cursor(row=index)
    await pilot.pause()
    assert app.selected_worker_id() == iid


async def test_drain_asks_and_can_be_cancelled(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        assert f"Drain worker {WORKER_A:x}" in app.screen.question
        await pilot.press("n")
        await app.workers.wait_for_complete()
        assert fake.calls == []
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("d", "y")
        await app.workers.wait_for_complete()
        await pilot.pause()
    assert fake.calls == [("drain", WORKER_A)]
    ev = recorded_state.recent_events(kinds=["action"])[0]
    assert ev.message == f"drain {WORKER_A:x}: ok: draining" and ev.instance_id == WORKER_A


async def test_sleep_asks_level_then_confirms(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_B)
        await pilot.press("s")
        assert isinstance(app.screen, SleepLevelScreen)
        await pilot.press("2")
        assert isinstance(app.screen, ConfirmScreen) and "level 2" in app.screen.question
        await pilot.press("y")
        await app.workers.wait_for_complete()
    assert fake.calls == [("sleep", WORKER_B, 2)]


async def test_wake_needs_no_confirmation(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("w")
        await app.workers.wait_for_complete()
    assert fake.calls == [("wake", WORKER_A)]


async def test_clear_kv_confirms(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen) and "KV cache" in app.screen.question
        await pilot.press("y")
        await app.workers.wait_for_complete()
    assert fake.calls == [("clear_kv", WORKER_A)]


async def test_load_lora_form(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("l")
        assert isinstance(app.screen, LoraLoadScreen)
        await pilot.press(*"bad/name", "enter")  # moves to the source field first
        await pilot.press(*"file:///adapters/a", "enter")
        assert isinstance(app.screen, LoraLoadScreen)  # a name with '/' is refused in the form
        app.screen.query_one("#lora-name", Input).value = "sql"
        app.screen.query_one("#lora-source", Input).focus()
        await pilot.press("enter")
        await app.workers.wait_for_complete()
    assert fake.calls == [("load_lora", WORKER_A, "sql", "file:///adapters/a")]


async def test_unload_lora_picks_from_loaded_ones(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("u")  # worker A has no adapter: nothing to ask
        await pilot.pause()
        assert not isinstance(app.screen, LoraUnloadScreen)
        await _select(app, pilot, WORKER_B)
        await pilot.press("u")
        assert isinstance(app.screen, LoraUnloadScreen)
        await pilot.press("enter")
        assert isinstance(app.screen, ConfirmScreen) and "sql-lora" in app.screen.question
        await pilot.press("y")
        await app.workers.wait_for_complete()
    assert fake.calls == [("unload_lora", WORKER_B, "sql-lora")]


async def test_failed_action_is_shown_as_an_error(recorded_state: ClusterState) -> None:
    fake = FakeControl(fail="worker is sleeping; wake it before draining")
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("d", "y")
        await app.workers.wait_for_complete()
        await pilot.pause()
        notes = [n.message for n in app._notifications]
    assert any("wake it before draining" in m for m in notes)
    ev = recorded_state.recent_events(kinds=["action"])[0]
    assert ev.severity == "error" and "failed" in ev.message


async def test_read_only_refuses_and_hides_actions(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake, read_only=True)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("d", "s", "c", "w")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]
        shown = {b.binding.action for b in app.active_bindings.values() if b.enabled}
        assert not any(a.startswith("act(") for a in shown)
        app.start_action("drain")  # the palette path is refused too
        await pilot.pause()
    assert fake.calls == []


async def test_colon_jumps_and_slash_filters(recorded_state: ClusterState) -> None:
    app = _app(recorded_state)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("colon", *"mod", "enter")
        assert app.current_view == "models"
        await pilot.press("2")
        assert app.current_view == "workers"
        all_rows = len(_row_keys(_table(app)))
        await pilot.press("slash", *"prefill")
        await pilot.pause()
        assert len(_row_keys(_table(app))) == 2
        await pilot.press("enter")  # keep the filter, close the prompt
        assert app.view().filter_text == "prefill"
        await pilot.press("escape")  # clears it
        await pilot.pause()
        assert len(_row_keys(_table(app))) == all_rows and app.view().filter_text == ""
        await pilot.press("colon", *"nope", "enter")
        await pilot.pause()
        assert app.current_view == "workers"


async def test_enter_drills_in_and_escape_goes_back(recorded_state: ClusterState) -> None:
    app = _app(recorded_state)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_B)
        await pilot.press("enter")
        assert isinstance(app.screen, WorkerScreen) and app.screen.instance_id == WORKER_B
        assert app.selected_worker_id() == WORKER_B  # actions act on the shown worker
        await pilot.press("escape")
        assert app.screen is app.screen_stack[0]
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert app.screen is app.screen_stack[0]


async def test_enter_on_a_model_shows_its_workers(recorded_state: ClusterState) -> None:
    app = _app(recorded_state)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("3")
        models = app.query_one("#models", DataTable)
        models.move_cursor(row=[r.key.value for r in models.ordered_rows].index("sql-lora"))
        await pilot.press("enter")
        await pilot.pause()
        assert app.current_view == "workers" and app.view().filter_text == "sql-lora"
        assert _row_keys(_table(app)) == [f"dynamo/backend/{WORKER_B:x}"]


async def test_topology_enter_on_instance_opens_worker(recorded_state: ClusterState) -> None:
    app = _app(recorded_state)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("1")
        tree = app.query_one("#topology")
        # Walk down to the first instance leaf under backend/generate.
        for _ in range(20):
            if app.selected_worker_id() is not None:
                break
            await pilot.press("down")
        assert app.selected_worker_id() is not None
        await pilot.press("enter")
        assert isinstance(app.screen, WorkerScreen)
        assert tree is not None


async def test_palette_runs_actions(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    app = _app(recorded_state, fake)
    async with app.run_test(size=SIZE) as pilot:
        await _select(app, pilot, WORKER_A)
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        await pilot.press(*"wake")
        commands = app.screen.query_one(CommandList)
        for _ in range(100):  # the palette searches in a worker: wait for its hits, not a fixed time
            if commands.option_count and commands.highlighted is not None:
                break
            await pilot.pause(0.05)
        assert "Wake" in str(commands.get_option_at_index(commands.highlighted).prompt)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
    assert fake.calls == [("wake", WORKER_A)]


async def test_refresh_follows_the_state(recorded_state: ClusterState) -> None:
    """New workers appear and status changes show without any key press."""
    from dynamod.shared.protocol.instance import Instance
    from dynamod.shared.protocol.keys import instance_key

    app = _app(recorded_state, refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        before = len(_row_keys(_table(app)))
        rec = Instance(namespace="dynamo", component="backend", endpoint="generate", instance_id=0xABC,
                       transport="tcp", address="127.0.0.1:1", role="agg", model="tiny")
        recorded_state.put_instance(instance_key("dynamo", "backend", "generate", 0xABC), rec)
        for _ in range(100):  # the refresh timer picks it up; poll with a deadline
            if len(_row_keys(_table(app))) == before + 1:
                break
            await pilot.pause(0.05)
        assert "dynamo/backend/abc" in _row_keys(_table(app))
