"""Encode workers (``dynamod --role encode``) in the console: a row of the Workers table with role
``encode``, the ``encode pool`` in the topology, and no part in the KV pools' figures (they hold
no KV), so an agg cluster with an encode pool still reads as aggregated."""

from __future__ import annotations

from textual.widgets import Static, Tree

from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.screens import WorkerScreen
from dynamod.shared.protocol.keys import instance_key
from tests.console.factories import NAMESPACE, make_instance, make_state, register
from tests.console.pilot import row_keys, until, workers_table

SIZE = (200, 30)  # wide enough for the ROLE column (the last one an agg table gives room)
WORKER, ENCODER = 0x11, 0x22


def _state():  # noqa: ANN202
    state, _ = make_state()
    register(state, WORKER)
    key = instance_key(NAMESPACE, "encoder", "encode", ENCODER)
    state.put_instance(key, make_instance(ENCODER, "encode", component="encoder", role="encode"))
    return state


async def test_encode_worker_in_workers_and_topology() -> None:
    state = _state()
    assert set(state.pools()) == {"agg"}
    app = ConsoleApp(state, initial_view="workers")
    async with app.run_test(size=SIZE) as pilot:
        table = workers_table(app)
        await until(pilot, lambda: len(row_keys(table)) == 2, what="two rows")
        key = next(k for k in row_keys(table) if k.endswith(f"{ENCODER:x}"))
        assert str(table.get_cell(key, "ROLE")) == "encode"
        table.move_cursor(row=table.get_row_index(key))
        await pilot.press("enter")  # its detail opens like any worker's
        assert isinstance(app.screen, WorkerScreen) and app.screen.instance_id == ENCODER
        title = app.screen.query_one("#title", Static)
        assert "ns/encoder/" in str(title.render())
        await pilot.press("escape")
        await pilot.press("1")
        tree = app.query_one("#topology", Tree)
        await until(pilot, lambda: any(str(n.label).startswith("encode pool") for n in tree._tree_nodes.values()),
                    what="the encode pool in the topology")
