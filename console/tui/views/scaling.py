"""Scaling: one row per pool (namespace x pool) with ready vs desired replicas, the operator's
override, the planner's budget, the live load (request rate, queued requests, ISL/OSL) and TTFT/ITL
against the SLA targets, all from the planner's status record as ``dynamoctl planner status`` shows
them; below it, the selected pool's facts, a plot of its desired vs ready replicas against load and
the SLA over the recent intervals (``scaling_plot.py``), its recent decisions with their reasons
(newest first), and the global routers with the pools they route to.

``r`` holds the selected pool at N replicas (an override; it asks first when that lowers
capacity) and ``x`` clears the override; both are refused in read-only mode. Columns are chosen
by priority to fit the terminal, like the Workers view: at 80 columns the pool, its sizes and the
SLA cells come first. Enter opens the pool's facts and its decisions with their full detail.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.actions.specs import POOL_ACTIONS
from dynamod.console.present import (
    SCALING_COLUMNS,
    fmt_age,
    global_router_line,
    scaling_row,
    sla_breached,
)
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.scaling import PoolScaling
from dynamod.console.tui.details import pool_detail
from dynamod.console.tui.messages import ShowDetail
from dynamod.console.tui.pool_facts import line as _line
from dynamod.console.tui.pool_facts import pool_facts
from dynamod.console.tui.style import plain
from dynamod.console.tui.views.base import (
    Cell,
    LiveTable,
    Row,
    ViewMixin,
    selected_key,
    sync_slots,
    sync_table,
)
from dynamod.console.tui.views.scaling_plot import scaling_plot
from dynamod.shared.security.printable import printable

# What is kept first when columns must go: sizes and the SLA before the prediction's details.
PRIORITY = ("POOL", "READY", "WANT", "OVERRIDE", "TTFT", "ITL", "REQ/S", "QUEUE", "BUDGET", "PLANNER", "LAST", "ISL",
            "OSL")
MIN_WIDTH = {"POOL": 12, "READY": 5, "WANT": 4, "OVERRIDE": 8, "TTFT": 9, "ITL": 8, "REQ/S": 6, "QUEUE": 5, "BUDGET": 6,
             "PLANNER": 7, "LAST": 10, "ISL": 5, "OSL": 4}
CELL_PADDING = 2
SCROLLBAR = 1
DECISION_COLUMNS = ("AGE", "ACTION", "SIZE", "REASON", "DETAIL")
_DECISION_WIDTHS = {"AGE": 4, "ACTION": 10, "SIZE": 6, "REASON": 17}
_COL_INDEX = {c: i for i, c in enumerate(SCALING_COLUMNS)}


def fit_scaling_columns(width: int, rows: list[tuple[str, ...]]) -> tuple[tuple[str, int], ...]:
    """(column, width) pairs that fit ``width``, in display order, widths from the content."""
    room = width - SCROLLBAR
    chosen: dict[str, int] = {}
    for col in PRIORITY:
        i = _COL_INDEX[col]
        w = max(len(col), MIN_WIDTH[col], *(len(r[i]) for r in rows)) if rows else max(len(col), MIN_WIDTH[col])
        if w + CELL_PADDING <= room:
            chosen[col] = w
            room -= w + CELL_PADDING
    return tuple((c, chosen[c]) for c in SCALING_COLUMNS if c in chosen)


def pool_cells(p: PoolScaling, row: tuple[str, ...], columns: tuple[str, ...]) -> tuple[Cell, ...]:
    """A pool's row with colour where it matters: an override stands out, a breached SLA is red,
    a pool short of its target is yellow."""
    out: list[Cell] = []
    for col in columns:
        cell = row[_COL_INDEX[col]]
        if col == "OVERRIDE" and p.override is not None:
            out.append(Text(cell, style="bold yellow"))
        elif col == "TTFT" and sla_breached(p.ttft_ms, p.targets.get("ttft_ms")):
            out.append(Text(cell, style="bold red"))
        elif col == "ITL" and sla_breached(p.itl_ms, p.targets.get("itl_ms")):
            out.append(Text(cell, style="bold red"))
        elif col == "READY" and p.target is not None and p.ready < p.target:
            out.append(Text(cell, style="yellow"))
        else:
            out.append(plain(cell))  # pool names and reasons come from discovery
    return tuple(out)


def pool_matches(p: PoolScaling, needle: str) -> bool:
    if not needle:
        return True
    hay = f"{p.key} {p.component} {p.planner} {p.last.reason if p.last else ''}"
    return needle.lower() in hay.lower()


class ScalingView(Vertical, ViewMixin):
    view_name = "scaling"
    BINDINGS = [Binding(a.key, f"pool_action('{a.name}')", a.short, tooltip=a.help) for a in POOL_ACTIONS]
    DEFAULT_CSS = """
    ScalingView #scaling-pools { height: auto; max-height: 8; }
    ScalingView #scaling-facts { height: auto; padding: 0 1; background: $boost; }
    ScalingView #scaling-plot { height: auto; padding: 0 1; }
    ScalingView #scaling-routers { height: auto; max-height: 3; padding: 0 1; color: $text-muted; display: none; }
    ScalingView #scaling-routers.shown { display: block; }
    ScalingView #scaling-decisions { height: 1fr; }
    ScalingView #scaling-empty { height: auto; padding: 1 2; color: $text-muted; display: none; }
    ScalingView #scaling-empty.shown { display: block; }
    """
    empty_hint = ("No pools yet: no workers, no planner. Start one with `dynamod up --planner load`; "
                  "an override (r) needs a pool to hold.")

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's parameter name
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._decision_cache: dict[str, tuple[Cell, ...]] = {}
        self._columns: tuple[tuple[str, int], ...] = ()
        self._decision_room = -1
        self._seen: tuple[int, ...] = ()
        self._pools: dict[str, PoolScaling] = {}
        self._shown_pool: str | None = None
        self._state: ClusterState | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="scaling-empty")
        yield LiveTable(id="scaling-pools", cursor_type="row", zebra_stripes=False)
        yield Static("", id="scaling-facts")
        yield Static("", id="scaling-plot")
        yield Static("", id="scaling-routers")
        yield LiveTable(id="scaling-decisions", cursor_type="none", zebra_stripes=False)

    @property
    def table(self) -> DataTable:
        return self.query_one("#scaling-pools", DataTable)

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        self._state = state
        now = state.clock()
        width = self.app.size.width
        v = state.versions
        # Decision ages tick over once a second even when nothing new arrived.
        seen = (v.scaling, v.topology, v.models, int(now), width)
        if not force and seen == self._seen:
            return
        self._seen = seen
        pools = [p for p in state.scaling_pools() if pool_matches(p, self.filter_text)]
        self._pools = {p.key: p for p in pools}
        rows_text = [scaling_row(p) for p in pools]
        wanted = fit_scaling_columns(width, rows_text)
        table = self.table
        if wanted != self._columns:
            table.clear(columns=True)
            for col, w in wanted:
                table.add_column(col, key=col, width=w)
            self._columns = wanted
            self._row_cache.clear()
        columns = tuple(c for c, _ in wanted)
        rows: list[Row] = [(p.key, pool_cells(p, r, columns)) for p, r in zip(pools, rows_text, strict=True)]
        sync_table(table, rows, self._row_cache)
        empty = self.query_one("#scaling-empty", Static)
        if not rows:
            empty.update(f"No pool matches /{self.filter_text}" if self.filter_text else self.empty_hint)
        empty.set_class(not rows, "shown")
        routers = state.global_routers()
        strip = self.query_one("#scaling-routers", Static)
        strip.update(Group(*(_line(global_router_line(g), max(20, width - 2)) for g in routers)))
        strip.set_class(bool(routers), "shown")
        self._show_pool(now, width)

    def _show_pool(self, now: float, width: int) -> None:
        """Facts and decisions of the pool under the cursor."""
        p = self.selected_pool()
        self._shown_pool = p.key if p is not None else None
        facts = self.query_one("#scaling-facts", Static)
        facts.update(pool_facts(p, width) if p is not None else "")
        facts.display = p is not None
        plot = scaling_plot(p, width) if p is not None else None
        chart = self.query_one("#scaling-plot", Static)
        chart.update(plot if plot is not None else "")
        chart.display = plot is not None
        dec = self.query_one("#scaling-decisions", DataTable)
        room = max(16, width - sum(w + CELL_PADDING for w in _DECISION_WIDTHS.values()) - CELL_PADDING - SCROLLBAR)
        if room != self._decision_room:
            dec.clear(columns=True)
            for col in DECISION_COLUMNS:
                dec.add_column(col, key=col, width=_DECISION_WIDTHS.get(col, room))
            self._decision_room = room
            self._decision_cache.clear()
        rows: list[list[Cell]] = []
        for d in p.decisions if p is not None else []:
            detail = Text(printable(d.detail or "-"), style="bold red" if d.error else "")
            if d.error:
                detail = Text(printable(f"failed: {d.error}"), style="bold red")
            detail.truncate(room, overflow="ellipsis")
            size = f"{d.current}->{d.desired}" if d.desired != d.current else str(d.current)
            action = Text(d.action, style="" if d.action == "hold" else "bold")
            rows.append([fmt_age(now - d.ts), action, size, plain(d.reason[: _DECISION_WIDTHS["REASON"]]), detail])
        sync_slots(dec, rows, self._decision_cache)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if self._state is not None and event.row_key.value != self._shown_pool:
            self._show_pool(self._state.clock(), self.app.size.width)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a pool: its facts and every decision with its full DETAIL (cut at 80 columns)."""
        event.stop()
        p = self._pools.get(event.row_key.value or "")
        if p is not None and self._state is not None:
            title, body = pool_detail(p, self._state.clock())
            self.post_message(ShowDetail(title, body))

    def selected_pool(self) -> PoolScaling | None:
        key = selected_key(self.table)
        return self._pools.get(key) if key else None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "pool_action" and getattr(self.app, "read_only", False):
            return False
        return True

    def action_pool_action(self, name: str) -> None:
        start = getattr(self.app, "start_pool_action", None)
        if start is not None:
            start(name)
