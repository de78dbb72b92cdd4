"""Router: the latest routing decisions with their explanation, and the candidate table (overlap,
prefill, decode, cost) of the highlighted one, when the router publishes ``router_decisions``."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.present import fmt_age
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.records import RouterDecision, fmt_id, fmt_num
from dynamod.console.tui.messages import ShowWorker
from dynamod.console.tui.views.base import (
    Cell,
    LiveTable,
    Row,
    ViewMixin,
    selected_key,
    sync_slots,
    sync_table,
)

DECISION_COLUMNS = ("AGE", "WORKER", "OVERLAP", "CANDS", "WHY")
_WIDTHS = {"AGE": 4, "WORKER": 16, "OVERLAP": 7, "CANDS": 5}
CANDIDATE_COLUMNS = ("", "WORKER", "DP", "OVERLAP", "PREFILL", "DECODE", "COST")
MAX_ROWS = 200


def decision_matches(d: RouterDecision, needle: str) -> bool:
    if not needle:
        return True
    hay = f"{fmt_id(d.worker_id)} {d.namespace} {d.request_id} " + " ".join(fmt_id(c.worker_id) for c in d.candidates)
    return needle.lower() in hay.lower()


class RouterView(Vertical, ViewMixin):
    view_name = "router"
    DEFAULT_CSS = """
    RouterView #decisions { height: 2fr; }
    RouterView #candidates { height: 1fr; min-height: 4; }
    RouterView #router-empty { height: auto; color: $text-muted; padding: 0 1; display: none; }
    RouterView #router-empty.shown { display: block; }
    """

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._cand_cache: dict[str, tuple[Cell, ...]] = {}
        self._by_key: dict[str, RouterDecision] = {}
        self._seen = (-1, -1.0)
        self._shown_key: tuple[str | None, int] = (None, -1)
        self._room = 0

    def compose(self) -> ComposeResult:
        yield Static("No routing decisions yet: a KV router publishes them on router_decisions.", id="router-empty")
        yield LiveTable(id="decisions", cursor_type="row")
        yield LiveTable(id="candidates", cursor_type="row", show_cursor=False)

    def _set_decision_columns(self, room: int) -> None:
        dec = self.query_one("#decisions", DataTable)
        dec.clear(columns=True)
        for col in DECISION_COLUMNS:
            dec.add_column(col, key=col, width=_WIDTHS.get(col, room))
        self._room = room
        self._row_cache.clear()

    def on_mount(self) -> None:
        cand = self.query_one("#candidates", DataTable)
        for col in CANDIDATE_COLUMNS:
            cand.add_column(col, key=col or "mark")

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        now = state.clock()
        seen = (state.versions.decisions, float(int(now)) + self.app.size.width * 1e10)
        if not force and seen == self._seen:
            return
        self._seen = seen
        # AGE, WORKER, OVERLAP, CANDS with their padding, and the scrollbar: the rest is for WHY.
        room = max(20, self.app.size.width - sum(w + 2 for w in _WIDTHS.values()) - 5)
        if room != self._room:
            self._set_decision_columns(room)
        rows: list[list[Cell]] = []
        self._by_key = {}
        count = 0
        for d in reversed(state.decisions):
            if not decision_matches(d, self.filter_text):
                continue
            key = str(count)
            self._by_key[key] = d
            why = Text(d.why(), no_wrap=True)
            why.truncate(room, overflow="ellipsis")
            rows.append([fmt_age(now - d.ts), fmt_id(d.worker_id), fmt_num(d.overlap_blocks), str(len(d.candidates)), why])
            count += 1
            if count >= MAX_ROWS:
                break
        self.query_one("#router-empty", Static).set_class(not state.decisions, "shown")
        sync_slots(self.query_one("#decisions", DataTable), rows, self._row_cache)
        self._show_candidates()

    def _show_candidates(self) -> None:
        """The candidates of the highlighted decision (slot rows: the decision under the cursor
        changes when new ones arrive, so this follows the decision, not the row)."""
        key = selected_key(self.query_one("#decisions", DataTable))
        d = self._by_key.get(key or "")
        shown = (key, id(d))
        if shown == self._shown_key:
            return
        self._shown_key = shown
        rows: list[Row] = []
        if d is not None:
            for i, c in enumerate(sorted(d.candidates, key=lambda c: (c.cost is None, c.cost or 0.0))):
                chosen = c.worker_id == d.worker_id and c.dp_rank == d.dp_rank
                rows.append(
                    (
                        f"{i}:{c.worker_id:x}:{c.dp_rank}",
                        (
                            Text("▶", style="bold green") if chosen else "",
                            fmt_id(c.worker_id),
                            str(c.dp_rank),
                            fmt_num(c.overlap_blocks),
                            fmt_num(c.prefill_blocks),
                            fmt_num(c.decode_blocks),
                            fmt_num(c.cost),
                        ),
                    )
                )
        sync_table(self.query_one("#candidates", DataTable), rows, self._cand_cache)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "decisions":
            self._show_candidates()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.data_table.id == "decisions":
            d = self._by_key.get(event.row_key.value or "")
            if d is not None:
                self.post_message(ShowWorker(d.worker_id))

    def selected_worker_id(self) -> int | None:
        d = self._by_key.get(selected_key(self.query_one("#decisions", DataTable)) or "")
        return d.worker_id if d else None
