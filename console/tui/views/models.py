"""Models: every served model and LoRA adapter with request rate, TTFT/ITL p50/p99, errors and
migrations from the frontends; Enter shows the workers that serve it."""

from __future__ import annotations

from textual.widgets import DataTable

from dynamod.console.present import fmt_count, fmt_ms, fmt_pct, fmt_rate
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.records import ModelInfo
from dynamod.console.tui.messages import JumpToView
from dynamod.console.tui.views.base import Cell, LiveTable, Row, ViewMixin, selected_key, sync_table

COLUMNS = ("MODEL", "KIND", "WRK", "REQ/S", "TTFT50", "TTFT99", "ITL50", "ITL99", "HIT", "ERR", "MIGR")


def model_cells(m: ModelInfo) -> tuple[Cell, ...]:
    s = m.stats
    kind = f"lora:{m.base_model}" if m.is_lora else "base"
    return (
        m.name,
        kind if len(kind) <= 14 else kind[:13] + "…",
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


class ModelsView(LiveTable, ViewMixin):
    view_name = "models"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id, cursor_type="row")
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._seen = (-1, -1)

    def on_mount(self) -> None:
        for col in COLUMNS:
            self.add_column(col, key=col)

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        seen = (state.versions.topology, state.versions.models)
        if not force and seen == self._seen:
            return
        self._seen = seen
        needle = self.filter_text.lower()
        rows: list[Row] = []
        for name, info in sorted(state.models().items()):
            if needle and needle not in f"{name} {info.base_model or ''}".lower():
                continue
            rows.append((name, model_cells(info)))
        sync_table(self, rows, self._row_cache)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        name = event.row_key.value
        if name:
            self.post_message(JumpToView("workers", name))

    def selected_model(self) -> str | None:
        return selected_key(self)
