"""Models: every served model and LoRA adapter with request rate, TTFT/ITL p50/p99, errors and
migrations from the frontends; Enter shows the workers that serve it. When a frontend's
``/metrics`` gives nothing (a 401 without an API key, no answer, an untrusted certificate) a line
above the table says why, instead of leaving the figures a silent ``-``."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.present import fmt_count, fmt_ms, fmt_pct, fmt_rate
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.records import ModelInfo
from dynamod.console.tui.messages import JumpToView
from dynamod.console.tui.style import plain
from dynamod.console.tui.views.base import Cell, LiveTable, Row, ViewMixin, selected_key, sync_table
from dynamod.shared.security.printable import printable

COLUMNS = ("MODEL", "KIND", "WRK", "REQ/S", "TTFT50", "TTFT99", "ITL50", "ITL99", "HIT", "ERR", "MIGR")


def model_cells(m: ModelInfo) -> tuple[Cell, ...]:
    s = m.stats
    kind = printable(f"lora:{m.base_model}") if m.is_lora else "base"
    return (
        plain(m.name),
        plain(kind if len(kind) <= 14 else kind[:13] + "…"),
        str(len(m.workers)),
        fmt_rate(s.request_rate),
        fmt_ms(s.ttft_p50),
        fmt_ms(s.ttft_p99),
        fmt_ms(s.itl_p50),
        fmt_ms(s.itl_p99),
        fmt_pct(s.hit_rate),
        fmt_count(s.errors_total),
        fmt_count(s.migrations_total),
    )


def problems_text(problems: list[str]) -> Text:
    """Why some figures are missing (a frontend's ``/metrics`` refused or unreachable), one reason
    a line, wrapped rather than cut: the end of it is the flag that fixes it."""
    return Text("\n".join("⚠ no figures: " + printable(reason) for reason in problems))


class ModelsView(Vertical, ViewMixin):
    view_name = "models"
    DEFAULT_CSS = """
    ModelsView #models-problems { height: auto; max-height: 6; color: $warning; padding: 0 1; display: none; }
    ModelsView #models-problems.shown { display: block; }
    ModelsView DataTable { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._seen: tuple[int, ...] = (-1, -1)
        self._problems: tuple[tuple[str, ...], int] = ((), 0)

    def compose(self) -> ComposeResult:
        yield Static("", id="models-problems")
        yield LiveTable(id="models-table", cursor_type="row")

    @property
    def table(self) -> DataTable:
        return self.query_one("#models-table", DataTable)

    def on_mount(self) -> None:
        for col in COLUMNS:
            self.table.add_column(col, key=col)

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        width = self.app.size.width
        seen = (state.versions.topology, state.versions.models, width)
        if not force and seen == self._seen:
            return
        self._seen = seen
        needle = self.filter_text.lower()
        rows: list[Row] = []
        for name, info in sorted(state.models().items()):
            if needle and needle not in f"{name} {info.base_model or ''}".lower():
                continue
            rows.append((name, model_cells(info)))
        sync_table(self.table, rows, self._row_cache)
        problems = (tuple(state.metric_problems()), width)
        if problems != self._problems:
            self._problems = problems
            banner = self.query_one("#models-problems", Static)
            banner.update(problems_text(list(problems[0])))
            banner.set_class(bool(problems[0]), "shown")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        name = event.row_key.value
        if name:
            self.post_message(JumpToView("workers", name))

    def selected_model(self) -> str | None:
        return selected_key(self.table)
