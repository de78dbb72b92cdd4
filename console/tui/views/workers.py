"""Workers: one row per engine worker with load, KV, hit rate, latency and a load sparkline, plus a
banner naming the hot or slow worker when the pool is out of balance."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.present import fmt_age, fmt_count, fmt_ms, fmt_pct, sparkline, worker_load_scale
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.records import Worker
from dynamod.console.tui.messages import ShowWorker
from dynamod.console.tui.style import status_text
from dynamod.console.tui.views.base import Cell, LiveTable, Row, ViewMixin, selected_key, sync_table

WIDE_MIN_COLS = 120
SPARK_WIDTH = 12
COMPACT = ("ID", "STATUS", "RUN", "WAIT", "KV", "HIT", "TTFT", "ITL", "LOAD")
WIDE = ("ID", "COMPONENT", "STATUS", "MODEL", "LORAS", "NODE", "RUN", "WAIT", "KV", "HIT", "TTFT", "ITL", "CACHED", "ROUTED", "AGE", "LOAD")


def worker_matches(w: Worker, needle: str) -> bool:
    if not needle:
        return True
    hay = f"{w.id_hex} {w.namespace}/{w.component} {w.role} {w.status} {w.model} {' '.join(w.loras)} {w.node}"
    return needle.lower() in hay.lower()


def worker_cells(
    w: Worker, columns: tuple[str, ...], now: float, scale: float, hot: set[int], spark: dict[int, tuple[int, float, str]] | None = None
) -> tuple[Cell, ...]:
    """The row of one worker. ``spark`` caches sparklines: they change once a second, not per refresh."""
    st = w.stats
    has_load = bool(st.loads)
    out: list[Cell] = []
    for col in columns:
        if col == "ID":
            out.append(Text(w.id_hex, style="bold red") if w.instance_id in hot else w.id_hex)
        elif col == "COMPONENT":
            out.append(f"{w.namespace}/{w.component}")
        elif col == "STATUS":
            out.append(status_text(w.status))
        elif col == "MODEL":
            out.append(w.model or "-")
        elif col == "LORAS":
            out.append(",".join(sorted(w.loras)) or "-")
        elif col == "NODE":
            out.append(w.node or "-")
        elif col == "RUN":
            out.append(str(st.running) if has_load else "-")
        elif col == "WAIT":
            out.append(str(st.waiting) if has_load else "-")
        elif col == "KV":
            out.append(fmt_pct(st.kv_usage))
        elif col == "HIT":
            out.append(fmt_pct(st.hit_rate))
        elif col == "TTFT":
            out.append(fmt_ms(st.ttft_s))
        elif col == "ITL":
            out.append(fmt_ms(st.itl_s))
        elif col == "CACHED":
            out.append(fmt_count(st.cached_blocks) if st.kv_events else "-")
        elif col == "ROUTED":
            out.append(fmt_count(st.routed))
        elif col == "AGE":
            out.append(fmt_age(now - w.started_at if w.started_at else None))
        elif col == "LOAD":
            cached = spark.get(w.instance_id) if spark is not None else None
            if cached is not None and cached[0] == st.samples and cached[1] == scale:
                out.append(cached[2])
            else:
                line = sparkline(st.history, SPARK_WIDTH, scale)
                if spark is not None:
                    spark[w.instance_id] = (st.samples, scale, line)
                out.append(line)
    return tuple(out)


class WorkersView(Vertical, ViewMixin):
    view_name = "workers"
    DEFAULT_CSS = """
    WorkersView #imbalance { height: 1; color: $warning; padding: 0 1; display: none; }
    WorkersView #imbalance.shown { display: block; }
    WorkersView DataTable { height: 1fr; }
    WorkersView #workers-empty { height: auto; padding: 1 2; color: $text-muted; display: none; }
    WorkersView #workers-empty.shown { display: block; }
    """
    empty_hint = "No workers registered yet. Start a local cluster with `dynamod up`."

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's parameter name
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._columns: tuple[str, ...] = ()
        self._seen: tuple[int, int] = (-1, -1)
        self._ids: dict[str, int] = {}
        self._spark: dict[int, tuple[int, float, str]] = {}

    def compose(self) -> ComposeResult:
        yield Static("", id="imbalance")
        yield Static("", id="workers-empty")
        yield LiveTable(id="workers-table", cursor_type="row", zebra_stripes=False)

    @property
    def table(self) -> DataTable:
        return self.query_one("#workers-table", DataTable)

    def _wanted_columns(self) -> tuple[str, ...]:
        return WIDE if self.app.size.width >= WIDE_MIN_COLS else COMPACT

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        seen = (state.versions.topology, state.versions.load)
        columns = self._wanted_columns()
        if not force and seen == self._seen and columns == self._columns:
            return
        self._seen = seen
        table = self.table
        if columns != self._columns:
            table.clear(columns=True)
            for col in columns:
                table.add_column(col, key=col)
            self._columns = columns
            self._row_cache.clear()
        now = state.clock()
        workers = [w for w in state.worker_list() if worker_matches(w, self.filter_text)]
        scale = worker_load_scale(workers)
        hot = {i.instance_id for i in state.imbalances}
        rows: list[Row] = []
        self._ids = {}
        for w in workers:
            key = f"{w.namespace}/{w.component}/{w.id_hex}"
            self._ids[key] = w.instance_id
            rows.append((key, worker_cells(w, columns, now, scale, hot, self._spark)))
        sync_table(table, rows, self._row_cache)
        empty = self.query_one("#workers-empty", Static)
        if not rows:
            empty.update(f"No worker matches /{self.filter_text}" if self.filter_text else self.empty_hint)
        empty.set_class(not rows, "shown")
        if len(self._spark) > 2 * len(rows) + 64:
            live = set(self._ids.values())
            self._spark = {k: v for k, v in self._spark.items() if k in live}
        banner = self.query_one("#imbalance", Static)
        if state.imbalances:
            count = len(state.imbalances)
            lead = f"⚠ {count} imbalances: " if count > 1 else "⚠ "
            banner.update(Text(lead + "; ".join(i.message for i in state.imbalances), no_wrap=True, overflow="ellipsis"))
            banner.add_class("shown")
        else:
            banner.remove_class("shown")

    def selected_worker_id(self) -> int | None:
        key = selected_key(self.table)
        return self._ids.get(key) if key else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        iid = self._ids.get(event.row_key.value or "")
        if iid is not None:
            self.post_message(ShowWorker(iid))
