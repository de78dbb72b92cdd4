"""Requests: the slowest recent requests the frontends traced, slowest first, with their model,
duration, time to first token, the workers that served them and whether they migrated.

The rows come from each frontend's ``GET /v1/traces?slowest=N`` (``collectors/traces.py``), polled
every few seconds only while this view is shown. Enter opens the request's waterfall
(``tui/trace_screen.py``), gathered from every frontend and worker as ``dynamoctl trace`` gathers it.
Columns are chosen by priority to fit the terminal; the request id takes what is left (cut with
``…`` at 80 columns when ids are long: the waterfall's header shows it whole). A line above the table
says where the rows come from, or why there are none.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.present import fmt_age
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.traces import STATUS_ERROR, RequestSummary
from dynamod.console.tui.messages import ShowTrace
from dynamod.console.tui.style import plain
from dynamod.console.tui.views.base import Cell, LiveTable, Row, ViewMixin, selected_key, sync_table
from dynamod.console.waterfall import cut, fmt_duration, short_worker
from dynamod.shared.security.printable import printable

COLUMNS = ("ID", "MODEL", "TIME", "TTFT", "WORKERS", "MIG", "AGE")
# Kept first when columns must go; the id is always shown and takes the room left.
PRIORITY = ("TIME", "TTFT", "MIG", "MODEL", "WORKERS", "AGE")
FIXED_WIDTH = {"TIME": 7, "TTFT": 7, "MIG": 3, "AGE": 4}
MEASURED_MAX = {"MODEL": 20, "WORKERS": 26, "ID": 40}
ID_MIN = 14
CELL_PADDING = 2
SCROLLBAR = 1
SHOWN = 100  # rows: the slowest of the merged lists


def workers_text(r: RequestSummary) -> str:
    return ",".join(short_worker(w) for w in r.worker_ids) or "-"


def request_texts(r: RequestSummary, now: float) -> dict[str, str]:
    return {
        "ID": printable(r.request_id),
        "MODEL": printable(r.model) or "-",
        "TIME": fmt_duration(int(r.duration_ms * 1e6)),
        "TTFT": fmt_duration(int(r.ttft_ms * 1e6)) if r.ttft_ms is not None else "-",
        "WORKERS": workers_text(r),
        "MIG": "yes" if r.migrated else "",
        "AGE": fmt_age(now - r.start_unix_ns / 1e9) if r.start_unix_ns else "-",
    }


def fit_request_columns(width: int, texts: list[dict[str, str]]) -> tuple[tuple[str, int], ...]:
    """(column, width) pairs in display order that fit ``width``: the priority columns while the
    id keeps ``ID_MIN``, then the id gets the rest (no more than its longest value)."""
    def measured(col: str) -> int:
        longest = max((len(t[col]) for t in texts), default=0)
        return max(len(col), min(MEASURED_MAX[col], longest))

    room = width - SCROLLBAR - (ID_MIN + CELL_PADDING)
    chosen: dict[str, int] = {}
    for col in PRIORITY:
        w = FIXED_WIDTH.get(col) or measured(col)
        if w + CELL_PADDING <= room:
            chosen[col] = w
            room -= w + CELL_PADDING
    chosen["ID"] = max(ID_MIN, min(measured("ID"), ID_MIN + room))
    return tuple((c, chosen[c]) for c in COLUMNS if c in chosen)


def request_matches(r: RequestSummary, needle: str) -> bool:
    if not needle:
        return True
    hay = f"{r.request_id} {r.model} {' '.join(r.worker_ids)} {r.status}"
    return needle.lower() in hay.lower()


class RequestsView(Vertical, ViewMixin):
    view_name = "requests"
    DEFAULT_CSS = """
    RequestsView #requests-status { height: auto; max-height: 3; padding: 0 1; color: $text-muted; }
    RequestsView #requests-table { height: 1fr; }
    """
    empty_hint = ("No traced requests yet. Frontends keep their recent requests' spans (sampled with "
                  "--trace-sample-rate); send one and it shows here.")
    no_frontend_hint = ("No frontend found in discovery to ask for its slowest requests; "
                        "name one with --frontend-url URL.")
    idle_hint = "Not connected to a cluster: the slowest requests come from the frontends' /v1/traces."

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's parameter name
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._columns: tuple[tuple[str, int], ...] = ()
        self._seen: tuple[int, ...] = ()
        self._rows: dict[str, RequestSummary] = {}
        self.polling = False  # the app says whether a poller feeds the board

    def compose(self) -> ComposeResult:
        yield Static("", id="requests-status")
        yield LiveTable(id="requests-table", cursor_type="row", zebra_stripes=False)

    @property
    def table(self) -> DataTable:
        return self.query_one("#requests-table", DataTable)

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        now = state.clock()
        width = self.app.size.width
        seen = (state.versions.requests, int(now), width, self.polling)
        if not force and seen == self._seen:
            return
        self._seen = seen
        board = state.requests
        shown = [r for r in board.slowest(SHOWN) if request_matches(r, self.filter_text)]
        self._rows = {r.request_id: r for r in shown}
        texts = [request_texts(r, now) for r in shown]
        wanted = fit_request_columns(width, texts)
        table = self.table
        if wanted != self._columns:
            table.clear(columns=True)
            for col, w in wanted:
                table.add_column(col, key=col, width=w)
            self._columns = wanted
            self._row_cache.clear()
        rows: list[Row] = []
        for r, t in zip(shown, texts, strict=True):
            cells: list[Cell] = []
            for col, w in wanted:
                if col == "ID":
                    cells.append(Text(cut(t["ID"], w), style="bold red" if r.status == STATUS_ERROR else ""))
                elif col == "MIG" and r.migrated:
                    cells.append(Text(t[col], style="bold yellow"))
                elif col in ("TIME", "TTFT", "AGE"):
                    cells.append(Text(t[col], justify="right"))
                else:
                    cells.append(plain(cut(t[col], w)))
            rows.append((r.request_id, tuple(cells)))
        sync_table(table, rows, self._row_cache)
        self.query_one("#requests-status", Static).update(self._status(state, len(shown), width))

    def _status(self, state: ClusterState, count: int, width: int) -> Text:
        board = state.requests
        problems = board.problems()
        text = Text(no_wrap=False)
        if problems:
            for p in problems[:2]:
                text.append(cut(printable(p), max(20, width - 2)) + "\n", style="yellow")
        if count:
            frontends = len(board.sources())
            text.append(f"{count} slowest recent requests from {frontends} frontend{'s' if frontends != 1 else ''}"
                        " · Enter: waterfall")
        elif self.filter_text:
            text.append(f"No request matches /{self.filter_text}")
        elif not self.polling and board.polled_at is None:
            text.append(self.idle_hint)
        elif board.polled_at is None:
            text.append("Asking the frontends for their slowest recent requests…")
        elif not board.sources():
            text.append(self.no_frontend_hint)
        elif not problems:
            text.append(self.empty_hint)
        text.rstrip()
        return text

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        rid = event.row_key.value
        if rid and rid in self._rows:
            self.post_message(ShowTrace(rid))

    def selected_request(self) -> RequestSummary | None:
        key = selected_key(self.table)
        return self._rows.get(key) if key else None
