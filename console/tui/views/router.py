"""Router: the latest routing decisions with their explanation, and the candidate table (overlap,
prefill, decode, cost) of the highlighted one, when the router publishes ``router_decisions``.

With disaggregated serving a request gives a prefill-stage and a decode-stage decision; the table
then shows each decision's STAGE and, on decode decisions, whether the prompt was prefilled
remotely or locally (PREFILL), and a summary above it counts remote vs local prefills with the
reasons and the latest one in words. Enter opens a decision's full explanation (WHY is cut at 80
columns), its disaggregation reason and every candidate's cost; Enter there opens the worker."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.present import fmt_age
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.decisions import HeardDecision
from dynamod.console.state.records import fmt_id, fmt_num
from dynamod.console.tui.details import decision_detail
from dynamod.console.tui.messages import ShowDetail
from dynamod.console.tui.views.base import (
    Cell,
    LiveTable,
    Row,
    ViewMixin,
    selected_key,
    sync_slots,
    sync_table,
)
from dynamod.shared.protocol.routing import DISAGG_LOCAL, DISAGG_REMOTE, STAGE_DECODE, STAGE_PREFILL
from dynamod.shared.security.printable import printable

DECISION_COLUMNS = ("AGE", "WORKER", "OVERLAP", "CANDS", "WHY")
_WIDTHS = {"AGE": 4, "WORKER": 16, "OVERLAP": 7, "CANDS": 5}
# With two stages, overlap and the candidate count give way to the stage and the prefill mode (both
# stay in the candidate table below).
DISAGG_COLUMNS = ("AGE", "STAGE", "WORKER", "PREFILL", "WHY")
_DISAGG_WIDTHS = {"AGE": 4, "STAGE": 7, "WORKER": 16, "PREFILL": 7}
CANDIDATE_COLUMNS = ("", "WORKER", "DP", "OVERLAP", "PREFILL", "DECODE", "COST")
MAX_ROWS = 200
MODE_STYLE = {DISAGG_REMOTE: "green", DISAGG_LOCAL: "yellow"}


def decision_matches(d: HeardDecision, needle: str) -> bool:
    if not needle:
        return True
    hay = f"{fmt_id(d.worker_id)} {d.namespace} {d.request_id} {d.stage} " + " ".join(fmt_id(c.worker_id) for c in d.candidates)
    if d.disagg is not None:
        hay += f" {d.disagg.mode} {d.disagg.reason} {fmt_id(d.disagg.prefill_worker_id)}"
    return needle.lower() in hay.lower()


def disagg_why(d: HeardDecision) -> str:
    """The WHY cell of a two-stage table: a local prefill's reason in words (what the operator
    tunes), a remote one's source worker, then the cost breakdown."""
    info = d.disagg
    if info is None:
        return d.cost_why()
    if info.mode == DISAGG_REMOTE:
        src = f"from {fmt_id(info.prefill_worker_id)}; " if info.prefill_worker_id is not None else ""
        return src + d.cost_why()
    return f"{info.reason}: {info.detail}" if info.detail else f"{info.reason}; {d.cost_why()}"


def disagg_summary(state: ClusterState, width: int) -> Text:
    """Two lines: remote vs local prefill counts with the local reasons, and the latest decision."""
    tally = state.decision_log.disagg
    text = Text(no_wrap=True, overflow="ellipsis")
    if not tally.total:
        text.append("prefill: no disaggregation decisions yet", style="dim")
        return text
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append("prefill ", style="bold")
    line.append(f"{tally.remote} remote", style="green")
    line.append(f" / {tally.local} local")
    line.append(f" ({tally.remote / tally.total:.0%} remote)", style="dim")
    local = tally.top_reasons(DISAGG_LOCAL)
    if local:
        line.append("  local: ", style="dim")
        line.append(", ".join(f"{reason or '?'} {n}" for reason, n in local))
    line.truncate(width, overflow="ellipsis")
    text.append_text(line)
    latest = tally.latest[-1]
    info = latest.disagg
    assert info is not None  # only decisions with disagg info are kept in ``latest``
    last = Text(no_wrap=True, overflow="ellipsis")
    last.append("\nlatest ", style="dim")
    last.append(f"{fmt_age(state.clock() - latest.ts)} {info.mode} {info.reason}", style="bold")
    if info.detail:
        last.append(f": {info.detail}")
    last.truncate(width + 1, overflow="ellipsis")
    text.append_text(last)
    return text


class RouterView(Vertical, ViewMixin):
    view_name = "router"
    DEFAULT_CSS = """
    RouterView #disagg { height: auto; padding: 0 1; display: none; background: $boost; }
    RouterView #disagg.shown { display: block; }
    RouterView #decisions { height: 2fr; }
    RouterView #candidates { height: 1fr; min-height: 4; }
    RouterView #router-empty { height: auto; color: $text-muted; padding: 0 1; display: none; }
    RouterView #router-empty.shown { display: block; }
    """

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._cand_cache: dict[str, tuple[Cell, ...]] = {}
        self._by_key: dict[str, HeardDecision] = {}
        self._seen = (-1, -1.0)
        self._shown_key: tuple[str | None, int] = (None, -1)
        self._room = 0
        self._two_stage = False
        self._now = 0.0

    def compose(self) -> ComposeResult:
        yield Static("No routing decisions yet: a KV router publishes them on router_decisions.", id="router-empty")
        yield Static("", id="disagg")
        yield LiveTable(id="decisions", cursor_type="row")
        yield LiveTable(id="candidates", cursor_type="row", show_cursor=False)

    def _set_decision_columns(self, room: int, two_stage: bool) -> None:
        dec = self.query_one("#decisions", DataTable)
        dec.clear(columns=True)
        widths = _DISAGG_WIDTHS if two_stage else _WIDTHS
        for col in DISAGG_COLUMNS if two_stage else DECISION_COLUMNS:
            dec.add_column(col, key=col, width=widths.get(col, room))
        self._room = room
        self._two_stage = two_stage
        self._row_cache.clear()

    def on_mount(self) -> None:
        cand = self.query_one("#candidates", DataTable)
        for col in CANDIDATE_COLUMNS:
            cand.add_column(col, key=col or "mark")

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        now = state.clock()
        self._now = now
        seen = (state.versions.decisions, float(int(now)) + self.app.size.width * 1e10)
        if not force and seen == self._seen:
            return
        self._seen = seen
        stages = state.decision_log.stages
        two_stage = bool(stages.get(STAGE_PREFILL) or stages.get(STAGE_DECODE))
        widths = _DISAGG_WIDTHS if two_stage else _WIDTHS
        # The fixed columns with their padding, and the scrollbar: the rest is for WHY.
        width = self.app.size.width
        room = max(20, width - sum(w + 2 for w in widths.values()) - 5)
        if room != self._room or two_stage != self._two_stage:
            self._set_decision_columns(room, two_stage)
        summary = self.query_one("#disagg", Static)
        if two_stage:
            summary.update(disagg_summary(state, width - 2))
        summary.set_class(two_stage, "shown")
        rows: list[list[Cell]] = []
        self._by_key = {}
        count = 0
        for d in reversed(state.decisions):
            if not decision_matches(d, self.filter_text):
                continue
            key = str(count)
            self._by_key[key] = d
            why = Text(printable(disagg_why(d) if two_stage else d.why()), no_wrap=True)
            why.truncate(room, overflow="ellipsis")
            if two_stage:
                mode = d.disagg.mode if d.disagg is not None else "-"
                rows.append([fmt_age(now - d.ts), d.stage, fmt_id(d.worker_id), Text(mode, style=MODE_STYLE.get(mode, "")), why])
            else:
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
            for i, c in enumerate(sorted(d.candidates, key=lambda c: c.cost)):
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
                title, body = decision_detail(d, self._now)
                self.post_message(ShowDetail(title, body, d.worker_id))

    def selected_worker_id(self) -> int | None:
        d = self._by_key.get(selected_key(self.query_one("#decisions", DataTable)) or "")
        return d.worker_id if d else None
