"""Pilot tests of the console's keyboard flow on a recorded cluster: navigation (``:``, ``/``,
Enter, Esc, ``?``), every action's prompt/confirm/result path, read-only mode, the palette.

The cluster side of each action is covered live in tests/console/test_console_live.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from textual.command import CommandList, CommandPalette
from textual.pilot import Pilot
from textual.screen import Screen
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
from dynamod.shared.protocol import control
from tests.console.fakes import FakeControl
from tests.console.fixtures.make_recording import WORKER_A, WORKER_B
from tests.console.pilot import cursor_to_worker, row_keys, until, workers_table

SIZE = (100, 30)


@asynccontextmanager
async def running(
    state: ClusterState, control: FakeControl | None = None, *, select: int | None = None, **kw: object
) -> AsyncIterator[tuple[ConsoleApp, Pilot]]:
    """The console on ``state`` at ``SIZE``, its actions going to ``control``, with the cursor on
    the worker ``select`` when given."""
    fake = control or FakeControl()
    app = ConsoleApp(state, control_factory=lambda: fake, **kw)
    async with app.run_test(size=SIZE) as pilot:
        if select is not None:
            await _select(app, pilot, select)
        yield app, pilot


async def _select(app: ConsoleApp, pilot: Pilot, iid: int) -> None:
    await cursor_to_worker(pilot, iid)
    assert app.selected_worker_id() == iid


# -- actions: prompt, confirm, result ---------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Keys pressed, then the screen that must show (``None``: no check) and, when it is a question,
    words it must ask; ``gone`` names a screen that must have closed."""

    keys: tuple[str, ...]
    screen: type[Screen] | None = None
    asks: str = ""
    gone: type[Screen] | None = None


@dataclass(frozen=True)
class Flow:
    """One action taken by keys on one worker, and what the operator must see come of it."""

    worker: int
    steps: tuple[Step, ...]
    calls: tuple[tuple, ...]  # what the control client was asked, in order
    logged: str  # the newest action event's message
    fail: str | None = None  # the worker refuses with this; the console must say so


FLOWS = [
    pytest.param(
        Flow(
            WORKER_A,
            (
                Step(("d",), ConfirmScreen, f"Drain worker {WORKER_A:x}"),
                Step(("n",), gone=ConfirmScreen),  # cancelled: nothing is sent
                Step(("d", "y")),
            ),
            (("drain", WORKER_A, control.DrainRequest(wait=False)),),
            f"drain {WORKER_A:x}: ok: draining",
        ),
        id="drain_asks_and_can_be_cancelled",
    ),
    pytest.param(
        Flow(
            WORKER_B,
            (Step(("s",), SleepLevelScreen), Step(("2",), ConfirmScreen, "level 2"), Step(("y",))),
            (("sleep", WORKER_B, control.SleepRequest(level=2)),),
            f"sleep {WORKER_B:x}: ok: sleeping at level 2",
        ),
        id="sleep_asks_level_then_confirms",
    ),
    pytest.param(
        Flow(WORKER_A, (Step(("w",)),), (("wake", WORKER_A, control.EmptyRequest()),), f"wake {WORKER_A:x}: ok: awake"),
        id="wake_needs_no_confirmation",
    ),
    pytest.param(
        Flow(
            WORKER_A,
            (Step(("c",), ConfirmScreen, "KV cache"), Step(("y",))),
            (("clear_kv", WORKER_A, control.ClearKvRequest()),),
            f"clear-kv {WORKER_A:x}: ok: cleared 12 cached blocks",
        ),
        id="clear_kv_confirms",
    ),
    pytest.param(
        Flow(
            WORKER_B,
            (Step(("u",), LoraUnloadScreen), Step(("enter",), ConfirmScreen, "sql-lora"), Step(("y",))),
            (("unload_lora", WORKER_B, control.UnloadLoraRequest(lora_name="sql-lora")),),
            f"lora unload {WORKER_B:x}: ok: unloaded sql-lora",
        ),
        id="unload_lora_picks_from_loaded_ones",
    ),
    pytest.param(
        Flow(
            WORKER_A,
            (Step(("d", "y")),),
            (("drain", WORKER_A, control.DrainRequest(wait=False)),),
            f"drain {WORKER_A:x}: failed: worker is sleeping; wake it before draining",
            fail="worker is sleeping; wake it before draining",
        ),
        id="failed_action_is_shown_as_an_error",
    ),
]


@pytest.mark.parametrize("flow", FLOWS)
async def test_action(recorded_state: ClusterState, flow: Flow) -> None:
    fake = FakeControl(fail=flow.fail)
    async with running(recorded_state, fake, select=flow.worker) as (app, pilot):
        for step in flow.steps:
            await pilot.press(*step.keys)
            if step.screen is not None:
                assert isinstance(app.screen, step.screen)
            if step.asks:
                assert step.asks in app.screen.question
            if step.gone is not None:
                await app.workers.wait_for_complete()
                assert not isinstance(app.screen, step.gone)
        await app.workers.wait_for_complete()
        await pilot.pause()
        notes = [n.message for n in app._notifications]
    assert fake.calls == list(flow.calls)
    ev = recorded_state.recent_events(kinds=["action"])[0]
    assert ev.message == flow.logged and ev.instance_id == flow.worker
    assert ev.severity == ("error" if flow.fail else "info")
    if flow.fail:
        assert any(flow.fail in m for m in notes)


async def test_unload_lora_asks_nothing_without_an_adapter(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    async with running(recorded_state, fake, select=WORKER_A) as (app, pilot):
        await pilot.press("u")  # worker A has no adapter: nothing to ask
        await pilot.pause()
        assert not isinstance(app.screen, LoraUnloadScreen)
    assert fake.calls == []


async def test_load_lora_form(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    async with running(recorded_state, fake, select=WORKER_A) as (app, pilot):
        await pilot.press("l")
        assert isinstance(app.screen, LoraLoadScreen)
        await pilot.press(*"bad/name", "enter")  # moves to the source field first
        await pilot.press(*"file:///adapters/a", "enter")
        assert isinstance(app.screen, LoraLoadScreen)  # a name with '/' is refused in the form
        app.screen.query_one("#lora-name", Input).value = "sql"
        app.screen.query_one("#lora-source", Input).focus()
        await pilot.press("enter")
        await app.workers.wait_for_complete()
    assert fake.calls == [("load_lora", WORKER_A, control.LoadLoraRequest(lora_name="sql", source=control.LoraSource(uri="file:///adapters/a")))]


async def test_read_only_refuses_and_hides_actions(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    async with running(recorded_state, fake, select=WORKER_A, read_only=True) as (app, pilot):
        await pilot.press("d", "s", "c", "w")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]
        shown = {b.binding.action for b in app.active_bindings.values() if b.enabled}
        assert not any(a.startswith("act(") for a in shown)
        app.start_action("drain")  # the palette path is refused too
        await pilot.pause()
    assert fake.calls == []


async def test_palette_runs_actions(recorded_state: ClusterState) -> None:
    fake = FakeControl()
    async with running(recorded_state, fake, select=WORKER_A) as (app, pilot):
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        await pilot.press(*"wake")
        commands = app.screen.query_one(CommandList)
        # The palette searches in a worker: wait for its hits, not a fixed time.
        await until(pilot, lambda: commands.option_count and commands.highlighted is not None, timeout=5.0,
                    what="the palette's hits")
        assert "Wake" in str(commands.get_option_at_index(commands.highlighted).prompt)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
    assert fake.calls == [("wake", WORKER_A, control.EmptyRequest())]


# -- navigation ---------------------------------------------------------------------------------------


async def test_colon_jumps_and_slash_filters(recorded_state: ClusterState) -> None:
    async with running(recorded_state) as (app, pilot):
        await pilot.press("colon", *"mod", "enter")
        assert app.current_view == "models"
        await pilot.press("2")
        assert app.current_view == "workers"
        all_rows = len(row_keys(workers_table(app)))
        await pilot.press("slash", *"prefill")
        await pilot.pause()
        assert len(row_keys(workers_table(app))) == 2
        await pilot.press("enter")  # keep the filter, close the prompt
        assert app.view().filter_text == "prefill"
        await pilot.press("escape")  # clears it
        await pilot.pause()
        assert len(row_keys(workers_table(app))) == all_rows and app.view().filter_text == ""
        await pilot.press("colon", *"nope", "enter")
        await pilot.pause()
        assert app.current_view == "workers"


async def test_enter_drills_in_and_escape_goes_back(recorded_state: ClusterState) -> None:
    async with running(recorded_state, select=WORKER_B) as (app, pilot):
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
    async with running(recorded_state) as (app, pilot):
        await pilot.press("3")
        models = app.query_one("#models-table", DataTable)
        models.move_cursor(row=row_keys(models).index("sql-lora"))
        await pilot.press("enter")
        await pilot.pause()
        assert app.current_view == "workers" and app.view().filter_text == "sql-lora"
        assert row_keys(workers_table(app)) == [f"dynamo/backend/{WORKER_B:x}"]


async def test_topology_enter_on_instance_opens_worker(recorded_state: ClusterState) -> None:
    async with running(recorded_state) as (app, pilot):
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


async def test_refresh_follows_the_state(recorded_state: ClusterState) -> None:
    """New workers appear and status changes show without any key press."""
    from dynamod.shared.protocol.instance import Instance
    from dynamod.shared.protocol.keys import instance_key

    async with running(recorded_state, refresh_s=0.05) as (app, pilot):
        before = len(row_keys(workers_table(app)))
        rec = Instance(namespace="dynamo", component="backend", endpoint="generate", instance_id=0xABC,
                       transport="tcp", address="127.0.0.1:1", role="agg", model="tiny")
        recorded_state.put_instance(instance_key("dynamo", "backend", "generate", 0xABC), rec)
        # The refresh timer picks it up; poll with a deadline.
        await until(pilot, lambda: len(row_keys(workers_table(app))) == before + 1, timeout=5.0, what="the new row")
        assert "dynamo/backend/0000000000000abc" in row_keys(workers_table(app))


async def test_a_refresh_tick_before_the_worker_screen_mounts_draws_nothing(recorded_state: ClusterState) -> None:
    """The refresh timer can tick between ``push_screen`` and the worker screen's mount, when the
    screen is already ``app.screen`` but has no widgets yet (a clean-clone CI run failed on
    ``NoMatches: '#title'``). That tick must pass; the mount draws the screen."""
    async with running(recorded_state) as (app, pilot):
        screen = WorkerScreen(app.state, WORKER_B)
        screen.refresh_from()  # composed nothing yet: no widget to write to
        await app.push_screen(screen)
        await pilot.pause()
        app.refresh_now()
        assert str(screen.query_one("#title").content).startswith(f"{app.state.find_worker(WORKER_B).namespace}/")
