"""One request's waterfall (Enter in the Requests view): the spans ``dynamoctl trace`` prints, in the
same layout (``console/waterfall.py``), gathered the same way (``actions/traces.py``).

The screen opens at once and gathers in the background: a line says so, then the facts (request,
trace, model, time, workers) and the waterfall replace it, or the one-line reason there is none.
Below the table the highlighted span's timing and attributes; Enter opens them in full (and from
there, Enter opens the span's worker). Esc goes back to the Requests view. At 80x24 the table
shows 16 spans at a time and scrolls.
"""

from __future__ import annotations

from typing import Protocol

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from dynamod.console.actions.traces import GatheredTrace
from dynamod.console.state.traces import Span
from dynamod.console.tui.messages import ShowDetail
from dynamod.console.tui.style import plain
from dynamod.console.waterfall import (
    COLUMNS,
    Waterfall,
    WaterfallRow,
    bar_text,
    cut,
    fmt_duration,
    header_lines,
    layout,
)
from dynamod.shared.errors import DynamoError
from dynamod.shared.security.printable import printable

COMPONENT_STYLE = {"frontend": "cyan", "router": "magenta", "prefill": "yellow", "decode": "green", "agg": "green",
                   "encode": "blue"}
ERROR_STYLE = "bold red"
# A DataTable pads each of its five cells by one column on either side, plus its scrollbar.
TABLE_CHROME = 5 * 2 + 1


class TraceSource(Protocol):
    """What gathers a request's spans: ``TraceGatherer``, or a recorded one in tests."""

    async def gather(self, request_id: str) -> GatheredTrace: ...


def span_facts(span: Span, t0: int) -> Text:
    """The highlighted span in two lines: when and how long, then its attributes."""
    text = Text(no_wrap=False)
    text.append(printable(span.name), style="bold")
    text.append(f"  {span.component}", style=COMPONENT_STYLE.get(span.component, ""))
    if span.worker_hex:
        text.append(f"  worker {printable(span.worker_hex)}")
    text.append(f"  +{fmt_duration(span.start_unix_ns - t0)}  took {fmt_duration(span.duration_ns)}")
    if span.status != "ok":
        text.append(f"  {span.status}", style=ERROR_STYLE)
    attrs = "  ".join(f"{k}={v}" for k, v in sorted(span.attributes.items()))
    if attrs:
        text.append("\n" + printable(attrs), style="dim")
    return text


def span_detail(span: Span, t0: int) -> Text:
    """Every field of a span, one per line, for the detail pane."""
    text = Text()
    fields = [("name", span.name), ("component", span.component), ("status", span.status),
              ("starts", f"+{fmt_duration(span.start_unix_ns - t0)}"), ("took", fmt_duration(span.duration_ns)),
              ("worker", span.worker_hex or "-"), ("instance", span.instance_id or "-"), ("trace_id", span.trace_id),
              ("span_id", span.span_id), ("parent_id", span.parent_id or "-")]
    fields += [(k, str(v)) for k, v in sorted(span.attributes.items())]
    for key, value in fields:
        text.append(f"{key:<12}", style="bold")
        text.append(printable(value) + "\n")
    text.rstrip()
    return text


def table_cells(row: WaterfallRow) -> tuple[Text, ...]:
    """A waterfall row as table cells, coloured by component; a failed span in red."""
    style = COMPONENT_STYLE.get(row.component, "")
    bar_style = ERROR_STYLE if row.error else style
    return (
        plain(row.label, ERROR_STYLE if row.error else ("dim" if row.orphan else "")),
        Text(row.component, style=style),
        plain(row.worker),
        Text(row.duration, justify="right"),
        Text(bar_text(row), style=bar_style),
    )


class TraceScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("enter", "open_span", "Span", show=False)]
    DEFAULT_CSS = """
    TraceScreen { layout: vertical; }
    TraceScreen #trace-title { height: 1; background: $primary-background; padding: 0 1; }
    TraceScreen #trace-facts { height: auto; max-height: 3; padding: 0 1; }
    TraceScreen #trace-table { height: 1fr; }
    TraceScreen #trace-span { height: 2; padding: 0 1; background: $boost; }
    """

    def __init__(self, request_id: str, source: TraceSource | None) -> None:
        super().__init__()
        self.request_id = request_id
        self._source = source
        self.trace: GatheredTrace | None = None
        self.error: str | None = None
        self._wf: Waterfall | None = None
        self._laid_for = -1

    def compose(self) -> ComposeResult:
        yield Static(Text(cut(f"trace {printable(self.request_id)}", 78), style="bold"), id="trace-title")
        yield Static("", id="trace-facts")
        yield DataTable(id="trace-table", cursor_type="row", zebra_stripes=False)
        yield Static("", id="trace-span")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#trace-table").display = False
        self.query_one("#trace-span").display = False
        if self._source is None:
            self._show_error("not connected to a cluster: no frontend or worker to ask")
            return
        self.query_one("#trace-facts", Static).update(
            Text(f"gathering the spans of {printable(self.request_id)} from every frontend and worker…", style="dim"))
        self.run_worker(self._gather(self._source), name="trace", exclusive=True, exit_on_error=False)

    async def _gather(self, source: TraceSource) -> None:
        try:
            found = await source.gather(self.request_id)
        except (DynamoError, OSError, TimeoutError) as exc:
            self._show_error(str(exc) or type(exc).__name__)
            return
        self.show(found)

    def _show_error(self, message: str) -> None:
        self.error = message
        text = Text(printable(message), style=ERROR_STYLE)
        text.append("\nEsc goes back.", style="dim")
        self.query_one("#trace-facts", Static).update(text)

    def show(self, found: GatheredTrace) -> None:
        """Draws a gathered trace (also what a test calls with a recorded one)."""
        self.trace = found
        self._laid_for = -1
        self._draw()

    def on_resize(self) -> None:
        if self.trace is not None:
            self._draw()

    def _draw(self) -> None:
        found = self.trace
        if found is None or not self.is_mounted:
            return
        width = self.app.size.width
        if width == self._laid_for:
            return
        self._laid_for = width
        facts = Text("\n".join(header_lines(found.request_id, found.trace_id, found.spans, max(20, width - 2))))
        self.query_one("#trace-facts", Static).update(facts)
        wf = layout(found.spans, max(40, width - TABLE_CHROME), gap=0)
        self._wf = wf
        table = self.query_one("#trace-table", DataTable)
        table.clear(columns=True)
        labels = (*COLUMNS[:3], COLUMNS[3].rjust(wf.widths[3]), wf.scale_label())
        for label, w in zip(labels, wf.widths, strict=True):
            table.add_column(label, width=w)
        for i, row in enumerate(wf.rows):
            table.add_row(*table_cells(row), key=str(i))
        table.display = True
        self.query_one("#trace-span").display = True
        table.focus()
        self._show_span(table.cursor_row)

    def _span_at(self, index: int) -> WaterfallRow | None:
        wf = self._wf
        return wf.rows[index] if wf is not None and 0 <= index < len(wf.rows) else None

    def _show_span(self, index: int) -> None:
        row = self._span_at(index)
        if row is not None and self._wf is not None:
            self.query_one("#trace-span", Static).update(span_facts(row.span, self._wf.start_ns))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._show_span(event.cursor_row)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open_span()

    def action_open_span(self) -> None:
        row = self._span_at(self.query_one("#trace-table", DataTable).cursor_row)
        if row is None or self._wf is None:
            return
        worker = row.span.worker_hex
        try:
            worker_id = int(worker, 16) if worker else None
        except ValueError:
            worker_id = None
        title = f"span {row.span.name} of {self.request_id}"
        self.post_message(ShowDetail(printable(title), span_detail(row.span, self._wf.start_ns), worker_id))
