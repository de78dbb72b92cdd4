"""The console's Requests view and request waterfall (issue 30 item 3), driven with Pilot and
compared as snapshots at 80x24, on the recorded trace payloads (``trace_fakes``): the real poller
and the real gatherer run against recorded frontend and worker answers.

Update the snapshots after an intended visual change with ``--snapshot-update`` and look at the SVGs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from dynamod.console.collectors.traces import SlowestPoller
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.traces import parse_summary
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.trace_screen import TraceScreen
from dynamod.console.tui.views.requests import RequestsView
from tests.console import trace_fakes
from tests.console.factories import make_state, register
from tests.console.pilot import row_keys, until
from tests.console.trace_fakes import FRONTEND_URL, SECOND_FRONTEND_URL, FakeFrontends, recorded_gatherer

SIZE = (80, 24)
RID = "req-7f3a9c"


def filled_state() -> ClusterState:
    """A small cluster whose two frontends' slowest lists are in the board (as one poll leaves it)."""
    fx = trace_fakes.load()
    state, _ = make_state(now=fx["now_unix_s"])
    for iid in (0x7A3F00C2D9E1B456, 0x5E21A9F0C4D3B287, 0x9B8C7D6E5F4A3B2C):
        register(state, iid)
    for url, rows in fx["slowest"].items():
        state.requests.apply(url, [parse_summary(r, url) for r in rows])
    return state


def app_with_traces(state: ClusterState, **kw: object) -> ConsoleApp:
    return ConsoleApp(state, initial_view="requests", trace_factory=lambda: recorded_gatherer()[0], **kw)  # type: ignore[arg-type]


def requests_table(app: ConsoleApp) -> DataTable:
    return app.query_one("#requests-table", DataTable)


async def open_waterfall(pilot: Pilot, row: int = 0) -> TraceScreen:
    requests_table(pilot.app).move_cursor(row=row)
    await pilot.press("enter")
    await until(pilot, lambda: isinstance(pilot.app.screen, TraceScreen), what="the trace screen")
    screen = pilot.app.screen
    assert isinstance(screen, TraceScreen)
    await until(pilot, lambda: screen.trace is not None or screen.error is not None, what="the gathered trace")
    await pilot.pause()
    return screen


async def test_the_slowest_requests_come_first_with_their_workers_and_migration() -> None:
    app = app_with_traces(filled_state())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        table = requests_table(app)
        assert row_keys(table) == [RID, "chatcmpl-4e1f0b2a9c8d7e6f5a4b3c2d1e0f9a8b", "req-5d21", "req-91aa", "req-0c44"]
        # At 80 columns the age is the column that gives way to three worker ids.
        assert [c.label.plain for c in table.columns.values()] == ["ID", "MODEL", "TIME", "TTFT", "WORKERS", "MIG"]
        first = [str(c) for c in table.get_row(RID)]
        assert first == [RID, "tiny", "612.4ms", "58.2ms", "7a3f00c2,5e21a9f0,9b8c7d6e", "yes"]
        assert [str(c) for c in table.get_row("req-5d21")][3] == "-"  # failed before a first token
        # every column fits 80 columns: the long id is cut, the waterfall shows it whole
        assert str(table.get_row("chatcmpl-4e1f0b2a9c8d7e6f5a4b3c2d1e0f9a8b")[0]).endswith("…")
        status = str(app.query_one("#requests-status", Static).render())
        assert "5 slowest recent requests from 2 frontends" in status
        # / filters by id, model or worker, as in every view
        await pilot.press("slash", *"lora", "enter")
        await pilot.pause()
        assert row_keys(table) == ["req-5d21"]
        await pilot.press("escape")
        await pilot.pause()
        assert len(row_keys(table)) == 5


async def test_the_frontends_are_polled_only_while_the_view_is_shown() -> None:
    fx = trace_fakes.load()
    frontends = FakeFrontends({}, fx["slowest"])
    state, _ = make_state(now=fx["now_unix_s"])
    polls: list[SlowestPoller] = []

    def poller() -> SlowestPoller:
        polls.append(SlowestPoller(state.requests, lambda: [FRONTEND_URL, SECOND_FRONTEND_URL], frontends.http(),
                                   interval_s=0.05))
        return polls[-1]

    app = ConsoleApp(state, initial_view="workers", poller_factory=poller)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert polls == [] and frontends.asked == []
        await pilot.press("7")
        await until(pilot, lambda: len(row_keys(requests_table(app))) == 5, what="the polled rows")
        assert app.polling_requests
        assert any(a.endswith("?slowest=50") for a in frontends.asked)
        await pilot.press("2")
        await pilot.pause()
        assert not app.polling_requests
        asked = len(frontends.asked)
        await pilot.press("3")  # another view: still nobody polls
        await pilot.pause(0.2)
        assert len(frontends.asked) == asked
        await pilot.press("7")
        await until(pilot, lambda: len(frontends.asked) > asked, what="polling again")
        assert len(polls) == 2


async def test_a_frontend_that_refuses_is_named_above_the_table() -> None:
    fx = trace_fakes.load()
    frontends = FakeFrontends({}, fx["slowest"], key="k-0123456789abcdef")
    state, _ = make_state(now=fx["now_unix_s"])
    app = ConsoleApp(state, initial_view="requests", poller_factory=lambda: SlowestPoller(
        state.requests, lambda: [FRONTEND_URL], frontends.http(), interval_s=0.05))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: state.requests.problems(), what="the refusal")
        app.refresh_now()
        await pilot.pause()
        status = str(app.query_one("#requests-status", Static).render())
        assert "401 from http://127.0.0.1:8000/v1/traces: the frontend wants a key" in status


async def test_without_a_frontend_the_view_says_how_to_name_one() -> None:
    state, _ = make_state()
    app = ConsoleApp(state, initial_view="requests", poller_factory=lambda: SlowestPoller(
        state.requests, list, FakeFrontends({}).http(), interval_s=0.05))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "--frontend-url" in str(app.query_one("#requests-status", Static).render()),
                    what="the hint")


async def test_enter_opens_the_waterfall_and_escape_goes_back() -> None:
    app = app_with_traces(filled_state())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        screen = await open_waterfall(pilot)
        assert screen.trace is not None and screen.trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
        table = screen.query_one("#trace-table", DataTable)
        assert table.row_count == 19
        assert str(table.get_row_at(0)[0]) == "http-request"
        facts = str(screen.query_one("#trace-facts", Static).render())
        assert f"request {RID}" in facts and "migrated yes" in facts
        # the highlighted span's attributes below the table; Enter shows every field
        await pilot.press("down")
        assert "preprocess" in str(screen.query_one("#trace-span", Static).render())
        await pilot.press("d")  # worker keys do nothing here
        assert isinstance(app.screen, TraceScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert len(app.screen_stack) == 1 and app.current_view == "requests"
        assert app.query_one(RequestsView).selected_request().request_id == RID  # type: ignore[union-attr]


async def test_a_request_the_cluster_no_longer_holds_says_so_on_one_line() -> None:
    app = app_with_traces(filled_state())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        screen = await open_waterfall(pilot, row=2)  # req-5d21: not in the recorded rings
        assert screen.error is not None
        assert screen.error.startswith("no spans for request req-5d21: asked 1 frontend and 3 workers")


def _waterfall(row: int = 0, then: tuple[str, ...] = ()) -> Callable[[Pilot], Awaitable[None]]:
    async def run_before(pilot: Pilot) -> None:
        await pilot.pause()
        await open_waterfall(pilot, row)
        if then:
            await pilot.press(*then)
        await pilot.pause()

    return run_before


def test_requests_view_snapshot(snap_compare) -> None:
    assert snap_compare(app_with_traces(filled_state()), terminal_size=SIZE)


def test_waterfall_snapshot(snap_compare) -> None:
    assert snap_compare(app_with_traces(filled_state()), run_before=_waterfall(), terminal_size=SIZE)


def test_span_detail_snapshot(snap_compare) -> None:
    """Enter on a span (the failed decode): every field and attribute."""
    assert snap_compare(app_with_traces(filled_state()), run_before=_waterfall(then=("down",) * 11 + ("enter",)),
                        terminal_size=SIZE)
