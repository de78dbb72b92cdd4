"""Events: registrations, expiries, drains, sleeps, LoRA changes, scaling decisions, errors and
action results, newest first; ``/`` filters by any word (kind, id, text); Enter opens an event's
full message (at 80 columns a registration's ``node=...`` is cut)."""

from __future__ import annotations

from textual.widgets import DataTable

from dynamod.console.present import fmt_age
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.records import ClusterEvent, fmt_id
from dynamod.console.tui.details import event_detail
from dynamod.console.tui.messages import ShowDetail
from dynamod.console.tui.style import severity_text
from dynamod.console.tui.views.base import Cell, LiveTable, ViewMixin, sync_slots
from dynamod.shared.security.printable import printable

COMPACT = ("AGE", "KIND", "MESSAGE")
WIDE = ("AGE", "KIND", "INSTANCE", "MESSAGE")
WIDE_MIN_COLS = 120
MAX_ROWS = 500
# Fixed column widths (content; each column adds 2 cells of padding): the message gets the rest of
# the screen and ends in an ellipsis instead of scrolling sideways.
_WIDTHS = {"AGE": 4, "KIND": 10, "INSTANCE": 16}


class EventsView(LiveTable, ViewMixin):
    view_name = "events"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id, cursor_type="row")
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._seen: tuple[int, float, int] = (-1, -1.0, -1)
        self._columns_shown: tuple[tuple[str, ...], int] = ((), 0)
        self._shown: list[ClusterEvent] = []  # row i is self._shown[i]
        self._now = 0.0

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        now = state.clock()
        # Ages tick over once a second even when nothing new happened.
        width = self.app.size.width
        seen = (state.versions.events, float(int(now)), width)
        if not force and seen == self._seen:
            return
        self._seen = seen
        columns = WIDE if width >= WIDE_MIN_COLS else COMPACT
        room = max(20, width - sum(_WIDTHS[c] + 2 for c in columns if c in _WIDTHS) - 5)
        if (columns, room) != self._columns_shown:
            self.clear(columns=True)
            for col in columns:
                self.add_column(col, key=col, width=_WIDTHS.get(col, room))
            self._columns_shown = (columns, room)
            self._row_cache.clear()
        rows: list[list[Cell]] = []
        self._shown = state.recent_events(self.filter_text, limit=MAX_ROWS)
        self._now = now
        for ev in self._shown:
            message = severity_text(printable(ev.message), ev.severity)
            message.truncate(room, overflow="ellipsis")
            cells: list[Cell] = [fmt_age(now - ev.ts), severity_text(ev.kind, ev.severity)]
            if "INSTANCE" in columns:
                cells.append(fmt_id(ev.instance_id) if ev.instance_id is not None else "-")
            cells.append(message)
            rows.append(cells)
        sync_slots(self, rows, self._row_cache)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        index = int(event.row_key.value or -1)
        if 0 <= index < len(self._shown):
            ev = self._shown[index]
            title, body = event_detail(ev, self._now)
            self.post_message(ShowDetail(title, body, ev.instance_id))
