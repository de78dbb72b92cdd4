"""Helpers for Pilot tests of the console: wait for a condition with a deadline, read the Workers
table, put its cursor on a worker. Shared by the recorded-cluster tests, the snapshots and the
live-cluster tests, which all drive the same table."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from textual.app import App
from textual.pilot import Pilot
from textual.widgets import DataTable

WORKERS_TABLE = "#workers-table"


async def until(pilot: Pilot, predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    """Lets the app run until ``predicate`` holds (a deadline, not a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


def workers_table(app: App) -> DataTable:
    return app.query_one(WORKERS_TABLE, DataTable)


def row_keys(table: DataTable) -> list[str]:
    return [r.key.value for r in table.ordered_rows]


async def cursor_to_worker(pilot: Pilot, iid: int) -> None:
    """Moves the Workers table's cursor to the row of ``iid`` (row keys end in the hex id)."""
    table = workers_table(pilot.app)
    table.move_cursor(row=next(i for i, k in enumerate(row_keys(table)) if k.endswith(f"{iid:x}")))
    await pilot.pause()
