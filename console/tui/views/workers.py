"""Workers: one row per engine worker with load, KV, hit rate, latency and a load sparkline, plus a
banner naming the hot or slow worker when the pool is out of balance.

With disaggregated serving (a prefill or decode pool exists) a strip above the table sums each pool
(load, KV, transfer rate and times) and the table gains the role and per-worker KV transfer
columns. Columns are chosen by priority to fit the terminal: at 80 columns the identity, status,
role and queue come first, then transfer rate and latency; what does not fit is left out whole,
never cut (a status reads ``draining``, not ``draini``).

A worker ``dynamod up`` gave up on after a crash loop has no process and no instance id: it is a
``failed`` row named as the supervisor names it (``worker-1``), with a banner line giving its last
death and the command that restarts it; Enter opens the full record.

When a frontend's ``/metrics`` gives nothing (refused without an API key, unreachable), a line
says why the TTFT and ITL columns are ``-``.

When some worker has host or disk KV tiers (its load messages carry ``kv_tiers``), a ``TIER%``
column follows KV with each lower tier's occupancy (``H40 D12``); a cluster without tiers never
shows it. Likewise the encode pool: once an encode worker reports its load, ``ENC%`` (encoder busy
share) and ``IMG/S`` appear, on its row only (its KV columns read ``-``: it holds none), and once a
VL worker looked up an image, ``EMB`` gives its embedding-cache hit rate.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from dynamod.console.present import (
    POOL_COLUMNS,
    TIER_COLUMN,
    fmt_age,
    fmt_bytes_rate,
    fmt_count,
    fmt_ms,
    fmt_ms_value,
    fmt_pct,
    fmt_rate,
    fmt_tiers,
    pool_row,
    sparkline,
    worker_load_scale,
)
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.failed import STATUS_FAILED, FailedEntry
from dynamod.console.state.pools import is_disaggregated
from dynamod.console.state.records import Worker
from dynamod.console.state.tiers import TierFigures
from dynamod.console.state.transfers import TransferFigures
from dynamod.console.tui.details import failed_worker_detail
from dynamod.console.tui.messages import ShowDetail, ShowWorker
from dynamod.console.tui.style import plain, status_text
from dynamod.console.tui.views.base import Cell, LiveTable, Row, ViewMixin, selected_key, sync_table
from dynamod.shared.security.printable import printable

SPARK_WIDTH = 12
# Display order, and the cell width each column needs when fitting (text columns are measured).
COLUMN_WIDTH = {
    "ID": 16, "ROLE": 7, "COMPONENT": 0, "STATUS": 8, "MODEL": 0, "LORAS": 0, "NODE": 0, "RUN": 3, "WAIT": 4,
    "KV": 4, TIER_COLUMN: 9, "HIT": 4, "EMB": 4, "ENC%": 4, "IMG/S": 6, "TTFT": 5, "ITL": 5, "XFER/S": 7, "XFER50": 6, "XFER99": 6, "XFAIL": 5, "HELD": 4,
    "CACHED": 6, "ROUTED": 6, "AGE": 4, "LOAD": SPARK_WIDTH,
}
MEASURED = ("COMPONENT", "MODEL", "LORAS", "NODE")
# What is kept first when columns must go. A one-pool cluster has no use for ROLE (every row says
# agg) or transfer columns; a disaggregated one needs the role right after the status.
PRIORITY_AGG = ("ID", "STATUS", "RUN", "WAIT", "KV", TIER_COLUMN, "HIT", "EMB", "ENC%", "IMG/S", "TTFT", "ITL", "LOAD",
                "COMPONENT", "MODEL", "NODE", "LORAS", "CACHED", "ROUTED", "AGE", "ROLE")
PRIORITY_DISAGG = ("ID", "STATUS", "ROLE", "RUN", "WAIT", "KV", TIER_COLUMN, "XFER/S", "TTFT", "ITL", "XFER99", "HIT", "EMB",
                   "ENC%", "IMG/S", "LOAD",
                   "XFAIL", "HELD", "XFER50", "COMPONENT", "MODEL", "NODE", "LORAS", "CACHED", "ROUTED", "AGE")
CELL_PADDING = 2  # DataTable pads each cell by one column on either side
SCROLLBAR = 1


TRANSFER_COLUMNS = ("XFER/S", "XFER50", "XFER99", "XFAIL", "HELD")
ENCODER_COLUMNS = ("ENC%", "IMG/S")  # an encode worker's encoder: busy share and images/s (last report)
EMBEDDING_COLUMN = "EMB"  # a VL worker's embedding-cache hit rate since start
KV_COLUMNS = frozenset({"RUN", "WAIT", "KV", TIER_COLUMN, "HIT", "CACHED"})  # "-" on an encode worker: it holds no KV


def column_width(col: str, measured: dict[str, int]) -> int:
    """The content width a column is drawn with: fixed, so a cell that later grows (a worker going
    from ``ready`` to ``draining``) is never cut, and the fit below is exact."""
    return max(len(col), COLUMN_WIDTH[col], measured.get(col, 0))


def fit_columns(
    width: int, disaggregated: bool, measured: dict[str, int], *, transfers: bool = True, tiers: bool = False,
    encoders: bool = False, embeddings: bool = False,
) -> tuple[str, ...]:
    """The columns that fit ``width`` terminal columns, in display order: taken by priority, a
    column too wide for what is left is skipped (a narrower one after it may still fit). Until
    some worker reports a KV transfer, the transfer columns (all "-") come last; without a worker
    with KV tiers there is no tier column; without an encode worker's load report no encoder
    columns (and with one, ROLE ranks right after STATUS: it tells the encoders apart), without a VL worker's
    embedding lookup no EMB column."""
    room = width - SCROLLBAR
    chosen: set[str] = set()
    order = PRIORITY_DISAGG if disaggregated else PRIORITY_AGG
    if not tiers:
        order = tuple(c for c in order if c != TIER_COLUMN)
    if not encoders:
        order = tuple(c for c in order if c not in ENCODER_COLUMNS)
    elif not disaggregated:
        order = ("ID", "STATUS", "ROLE", *(c for c in order if c not in ("ID", "STATUS", "ROLE")))
    if not embeddings:
        order = tuple(c for c in order if c != EMBEDDING_COLUMN)
    if not transfers:
        order = tuple(c for c in order if c not in TRANSFER_COLUMNS) + TRANSFER_COLUMNS
    for col in order:
        need = column_width(col, measured) + CELL_PADDING
        if need <= room:
            chosen.add(col)
            room -= need
    return tuple(c for c in COLUMN_WIDTH if c in chosen)


def pools_table(rows: tuple[tuple[str, ...], ...]) -> Table:
    """The pool strip: one line per pool under a header (rows from ``present.pool_row``)."""
    table = Table(box=None, padding=(0, 1, 0, 0), show_edge=False, header_style="bold", pad_edge=False)
    for col in POOL_COLUMNS:
        table.add_column(col, no_wrap=True)
    for row in rows:
        table.add_row(Text(row[0], style="bold"), *row[1:])
    return table


def failed_cells(f: FailedEntry, columns: tuple[str, ...]) -> tuple[Cell, ...]:
    """The row of a failed worker: its name where the id goes, its pool, ``failed``; no figures."""
    out: list[Cell] = []
    for col in columns:
        if col == "ID":
            out.append(plain(f.name, "bold red"))
        elif col == "STATUS":
            out.append(status_text(STATUS_FAILED))
        elif col == "ROLE":
            out.append(plain(f.pool))
        elif col == "COMPONENT":
            out.append(plain(f"{f.namespace}/-"))
        else:
            out.append("-")
    return tuple(out)


def failed_banner(failed: list[FailedEntry]) -> Text:
    """One line: which workers were given up on, why, and how to try again."""
    if len(failed) == 1:
        f = failed[0]
        line = f"✗ {f.name}: {f.summary()}; dynamoctl restart {f.name}"  # its row's Enter has the rest
    else:
        line = f"✗ {len(failed)} failed workers: " + ", ".join(f"{f.name} ({f.record.reason or 'died'})" for f in failed)
    return Text(printable(line), no_wrap=True, overflow="ellipsis")


def failed_matches(f: FailedEntry, needle: str) -> bool:
    if not needle:
        return True
    return needle.lower() in f"{f.name} {f.namespace} {f.pool} {STATUS_FAILED} {f.record.reason}".lower()


def worker_matches(w: Worker, needle: str) -> bool:
    if not needle:
        return True
    hay = f"{w.id_hex} {w.namespace}/{w.component} {w.role} {w.status} {w.model} {' '.join(w.loras)} {w.node}"
    return needle.lower() in hay.lower()


def worker_cells(
    w: Worker,
    columns: tuple[str, ...],
    now: float,
    scale: float,
    hot: set[int],
    spark: dict[int, tuple[int, float, str]] | None = None,
    transfer: TransferFigures | None = None,
    tiers: dict[str, TierFigures] | None = None,
) -> tuple[Cell, ...]:
    """The row of one worker. ``spark`` caches sparklines: they change once a second, not per refresh."""
    st = w.stats
    has_load = bool(st.loads)
    encoder = w.is_encoder
    xfer = transfer if transfer is not None and transfer.seen else None
    out: list[Cell] = []
    for col in columns:
        if encoder and col in KV_COLUMNS:
            out.append("-")
        elif col == "ID":
            out.append(Text(w.id_hex, style="bold red") if w.instance_id in hot else w.id_hex)
        elif col == "ROLE":
            out.append(w.role or "-")
        elif col == "XFER/S":
            out.append(fmt_bytes_rate(xfer.bytes_per_s) if xfer else "-")
        elif col == "XFER50":
            out.append(fmt_ms_value(xfer.p50_ms) if xfer else "-")
        elif col == "XFER99":
            out.append(fmt_ms_value(xfer.p99_ms) if xfer else "-")
        elif col == "XFAIL":
            out.append(Text(str(xfer.failures), style="bold red") if xfer and xfer.failures else (str(0) if xfer else "-"))
        elif col == "HELD":
            out.append(fmt_count(xfer.held_blocks) if xfer else "-")
        elif col == "COMPONENT":
            out.append(plain(f"{w.namespace}/{w.component}"))
        elif col == "STATUS":
            out.append(status_text(w.status))
        elif col == "MODEL":
            out.append(plain(w.model or "-"))
        elif col == "LORAS":
            out.append(plain(",".join(sorted(w.loras)) or "-"))
        elif col == "NODE":
            out.append(plain(w.node or "-"))
        elif col == "RUN":
            out.append(str(st.running) if has_load else "-")
        elif col == "WAIT":
            out.append(str(st.waiting) if has_load else "-")
        elif col == "KV":
            out.append(fmt_pct(st.kv_usage))
        elif col == TIER_COLUMN:
            out.append(fmt_tiers(tiers or {}))
        elif col == "HIT":
            out.append(fmt_pct(st.hit_rate))
        elif col == EMBEDDING_COLUMN:
            out.append(fmt_pct(st.embedding_hit_rate))
        elif col == "ENC%":
            out.append(fmt_pct(st.encoder_busy) if encoder else "-")
        elif col == "IMG/S":
            out.append(fmt_rate(st.encode_images_per_s) if encoder else "-")
        elif col == "TTFT":
            out.append(fmt_ms(st.ttft_s))
        elif col == "ITL":
            out.append(fmt_ms(st.itl_s))
        elif col == "CACHED":
            out.append(fmt_count(st.cached_blocks) if st.kv_events or st.kv_seeded else "-")
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
    WorkersView #pools { height: auto; padding: 0 1; display: none; background: $boost; }
    WorkersView #pools.shown { display: block; }
    WorkersView #imbalance { height: 1; color: $warning; padding: 0 1; display: none; }
    WorkersView #imbalance.shown { display: block; }
    WorkersView #metrics-problem { height: auto; max-height: 2; color: $warning; padding: 0 1; display: none; }
    WorkersView #metrics-problem.shown { display: block; }
    WorkersView #failed { height: 1; color: $error; padding: 0 1; display: none; }
    WorkersView #failed.shown { display: block; }
    WorkersView DataTable { height: 1fr; }
    WorkersView #workers-empty { height: auto; padding: 1 2; color: $text-muted; display: none; }
    WorkersView #workers-empty.shown { display: block; }
    """
    empty_hint = "No workers registered yet. Start a local cluster with `dynamod up`."

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's parameter name
        super().__init__(id=id)
        self._row_cache: dict[str, tuple[Cell, ...]] = {}
        self._columns: tuple[tuple[str, int], ...] = ()
        self._seen: tuple[int, int, int] = (-1, -1, -1)
        self._ids: dict[str, int] = {}
        self._spark: dict[int, tuple[int, float, str]] = {}
        self._pool_rows: tuple[tuple[str, ...], ...] = ()
        self._failed: dict[str, FailedEntry] = {}
        self._now = 0.0

    def compose(self) -> ComposeResult:
        yield Static("", id="pools")
        yield Static("", id="metrics-problem")
        yield Static("", id="failed")
        yield Static("", id="imbalance")
        yield Static("", id="workers-empty")
        yield LiveTable(id="workers-table", cursor_type="row", zebra_stripes=False)

    @property
    def table(self) -> DataTable:
        return self.query_one("#workers-table", DataTable)

    def _wanted_columns(self, state: ClusterState, workers: list[Worker], disaggregated: bool) -> tuple[tuple[str, int], ...]:
        """(column, width) pairs: a wider measured column (a longer node name) rebuilds the table."""
        measured = {
            "COMPONENT": max((len(printable(f"{w.namespace}/{w.component}")) for w in workers), default=0),
            "MODEL": max((len(printable(w.model or "-")) for w in workers), default=0),
            "LORAS": max((len(printable(",".join(sorted(w.loras)) or "-")) for w in workers), default=0),
            "NODE": max((len(printable(w.node or "-")) for w in workers), default=0),
        }
        transfers = any(p.transfers_seen for p in state.pools().values())
        tiers = any(state.tiers.figures(w.instance_id) for w in workers)
        encoders = any(w.is_encoder and w.stats.loads for w in workers)
        embeddings = any(w.stats.embedding_lookups for w in workers)
        chosen = fit_columns(self.app.size.width, disaggregated, measured, transfers=transfers, tiers=tiers,
                             encoders=encoders, embeddings=embeddings)
        return tuple((col, column_width(col, measured)) for col in chosen)

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        seen = (state.versions.topology, state.versions.load, self.app.size.width)
        if not force and seen == self._seen:
            return
        self._seen = seen
        pools = state.pools()
        disaggregated = is_disaggregated(pools)
        workers = [
            w for w in state.worker_list(workers_only=False)
            if (w.is_worker or w.is_encoder) and worker_matches(w, self.filter_text)
        ]
        wanted = self._wanted_columns(state, workers, disaggregated)
        columns = tuple(col for col, _ in wanted)
        table = self.table
        if wanted != self._columns:
            table.clear(columns=True)
            for col, width in wanted:
                table.add_column(col, key=col, width=width)
            self._columns = wanted
            self._row_cache.clear()
        now = state.clock()
        scale = worker_load_scale(workers)
        hot = {i.instance_id for i in state.imbalances}
        rows: list[Row] = []
        self._ids = {}
        for w in workers:
            key = f"{w.namespace}/{w.component}/{w.id_hex}"
            self._ids[key] = w.instance_id
            rows.append((key, worker_cells(w, columns, now, scale, hot, self._spark, state.transfers.figures(w.instance_id),
                                           state.tiers.figures(w.instance_id))))
        failed = [f for f in state.failed() if failed_matches(f, self.filter_text)]
        self._failed = {}
        self._now = now
        for f in failed:
            key = f"failed/{f.namespace}/{f.name}"
            self._failed[key] = f
            rows.append((key, failed_cells(f, columns)))
        sync_table(table, rows, self._row_cache)
        problems = state.metric_problems()
        problem_line = self.query_one("#metrics-problem", Static)
        if problems:
            more = f" (+{len(problems) - 1} more: see models)" if len(problems) > 1 else ""
            # Two lines at most, wrapped: the fix (the flag to give) is at the end of the reason.
            problem_line.update(Text(printable(f"⚠ no TTFT/ITL: {problems[0]}{more}")))
        problem_line.set_class(bool(problems), "shown")
        failed_line = self.query_one("#failed", Static)
        if failed:
            failed_line.update(failed_banner(failed))
        failed_line.set_class(bool(failed), "shown")
        empty = self.query_one("#workers-empty", Static)
        if not rows:
            empty.update(f"No worker matches /{self.filter_text}" if self.filter_text else self.empty_hint)
        empty.set_class(not rows, "shown")
        if len(self._spark) > 2 * len(rows) + 64:
            live = set(self._ids.values())
            self._spark = {k: v for k, v in self._spark.items() if k in live}
        strip = self.query_one("#pools", Static)
        pool_rows = tuple(pool_row(p) for p in pools.values()) if disaggregated else ()
        if pool_rows != self._pool_rows:
            self._pool_rows = pool_rows
            strip.update(pools_table(pool_rows))
        strip.set_class(disaggregated, "shown")
        banner = self.query_one("#imbalance", Static)
        if state.imbalances:
            count = len(state.imbalances)
            lead = f"⚠ {count} imbalances: " if count > 1 else "⚠ "
            banner.update(Text(printable(lead + "; ".join(i.message for i in state.imbalances)), no_wrap=True,
                               overflow="ellipsis"))
            banner.add_class("shown")
        else:
            banner.remove_class("shown")

    def selected_worker_id(self) -> int | None:
        key = selected_key(self.table)
        return self._ids.get(key) if key else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        key = event.row_key.value or ""
        iid = self._ids.get(key)
        if iid is not None:
            self.post_message(ShowWorker(iid))
            return
        failed = self._failed.get(key)
        if failed is not None:
            title, body = failed_worker_detail(failed.namespace, failed.record, self._now)
            self.post_message(ShowDetail(title, body))
