"""One request's spans as a waterfall: the layout ``dynamoctl trace`` prints and the console's trace
screen draws, so both read the same at 80 columns.

Rows are the span tree in time order: a span under its parent, indented one step per level,
siblings by start; a span whose parent was not gathered (a process that did not answer, a ring that
already dropped it) is shown at the top level rather than lost. Each row has the span's name, its
component, the worker it ran on (short hex: a unique prefix ``dynamoctl`` verbs accept), its
duration and a bar placed and sized on one time scale: the whole trace, from the first start to
the last end, spans the bar column, so a bar's position says when and its length how long.

Widths are fitted to the terminal: component, worker and duration keep their width, the name gets
what the bar can spare down to ``NAME_MIN``, and nothing is wider than asked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dynamod.console.state.traces import STATUS_ERROR, Span
from dynamod.shared.observability.tracing import SPAN_MIGRATION
from dynamod.shared.security.printable import printable

NAME_MIN = 12
NAME_MAX = 32
COMPONENT_WIDTH = 8  # "frontend"
WORKER_WIDTH = 8
DURATION_WIDTH = 7  # "999.9ms", "12.34s"
BAR_MIN = 8
BAR_PREFERRED = 24  # the name gives way up to here: the timeline is the point of the view
MAX_INDENT_DEPTH = 8  # deeper levels keep this indent: the name must stay readable
INDENT = "  "
BAR = "█"
ERROR_MARK = " !"
COLUMNS = ("SPAN", "COMP", "WORKER", "TIME")


def fmt_duration(ns: int) -> str:
    """A span's duration in at most ``DURATION_WIDTH`` characters: ms below a second, then s."""
    ms = ns / 1e6
    if ms < 1000:
        return f"{ms:.1f}ms"
    if ms < 100_000:
        return f"{ms / 1000:.2f}s"
    return f"{ms / 1000:.0f}s"


def short_worker(hex_id: str | None) -> str:
    """A worker id as the waterfall shows it: leading zeros dropped, then at most 8 digits (a
    prefix ``dynamoctl drain`` and friends resolve); ``-`` for a span with no worker."""
    if not hex_id:
        return "-"
    return (hex_id.lower().lstrip("0") or "0")[:WORKER_WIDTH]


def cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


@dataclass(frozen=True, slots=True)
class WaterfallRow:
    span: Span
    depth: int
    orphan: bool  # its parent was not among the spans
    label: str  # indented name, cut to the name width
    component: str
    worker: str
    duration: str
    bar_start: int  # cells from the left of the bar column
    bar_len: int  # at least 1: every span is visible

    @property
    def error(self) -> bool:
        return self.span.status == STATUS_ERROR


@dataclass(frozen=True, slots=True)
class Waterfall:
    rows: tuple[WaterfallRow, ...]
    start_ns: int
    end_ns: int
    name_width: int
    bar_width: int
    gap: int

    @property
    def total_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def widths(self) -> tuple[int, int, int, int, int]:
        """Column widths in display order: name, component, worker, duration, bar."""
        return (self.name_width, COMPONENT_WIDTH, WORKER_WIDTH, DURATION_WIDTH, self.bar_width)

    def scale_label(self) -> str:
        """The bar column's header: 0 at the left, the trace's length at the right."""
        end = fmt_duration(self.total_ns)
        return "0" + " " * max(1, self.bar_width - 1 - len(end)) + end if self.bar_width > len(end) + 1 else end[: self.bar_width]


def span_tree(spans: Iterable[Span]) -> list[tuple[Span, int, bool]]:
    """(span, depth, orphan) in display order: depth first, children by start. A parent link that
    loops (a malformed trace) is broken where the loop closes, so every span is shown once."""
    ordered = sorted(spans, key=lambda s: (s.start_unix_ns, s.end_unix_ns, s.span_id))
    ids = {s.span_id for s in ordered}
    children: dict[str, list[Span]] = {}
    roots: list[Span] = []
    for s in ordered:
        if s.parent_id is not None and s.parent_id in ids and s.parent_id != s.span_id:
            children.setdefault(s.parent_id, []).append(s)
        else:
            roots.append(s)
    out: list[tuple[Span, int, bool]] = []
    placed: set[str] = set()

    def walk(span: Span, depth: int, orphan: bool) -> None:
        stack = [(span, depth, orphan)]
        while stack:
            s, d, o = stack.pop()
            if s.span_id in placed:
                continue
            placed.add(s.span_id)
            out.append((s, d, o))
            stack.extend((c, d + 1, False) for c in reversed(children.get(s.span_id, [])))

    for root in roots:
        walk(root, 0, root.parent_id is not None)
    for s in ordered:  # spans only reachable through a loop
        if s.span_id not in placed:
            walk(s, 0, True)
    return out


def bar_cells(start_ns: int, end_ns: int, t0: int, total_ns: int, width: int) -> tuple[int, int]:
    """Where a span's bar starts and how many cells it takes in a ``width``-cell column that
    stands for ``total_ns`` from ``t0``: start rounded down, end up, at least one cell."""
    total = max(1, total_ns)
    first = min(width - 1, max(0, math.floor((start_ns - t0) * width / total)))
    last = min(width, max(first + 1, math.ceil((end_ns - t0) * width / total)))
    return first, last - first


def fit_name_width(labels: Iterable[str], width: int, gap: int) -> tuple[int, int]:
    """(name width, bar width) for a line of ``width`` cells with ``gap`` between columns."""
    fixed = COMPONENT_WIDTH + WORKER_WIDTH + DURATION_WIDTH + 4 * gap
    rest = max(NAME_MIN + BAR_MIN, width - fixed)
    longest = max((len(label) for label in labels), default=NAME_MIN)
    name = max(NAME_MIN, min(longest, NAME_MAX, rest - BAR_PREFERRED))
    return name, max(BAR_MIN, rest - name)


def layout(spans: Iterable[Span], width: int = 80, *, gap: int = 1) -> Waterfall:
    """The waterfall of ``spans`` for a line of ``width`` cells whose columns are ``gap`` apart
    (1 for text; a table that pads its cells itself passes 0 and its own width)."""
    tree = span_tree(spans)
    if not tree:
        return Waterfall((), 0, 0, NAME_MIN, BAR_MIN, gap)
    t0 = min(s.start_unix_ns for s, _, _ in tree)
    t1 = max(s.end_unix_ns for s, _, _ in tree)
    names = [INDENT * min(d, MAX_INDENT_DEPTH) + printable(s.name) + (ERROR_MARK if s.status == STATUS_ERROR else "")
             for s, d, _ in tree]
    name_w, bar_w = fit_name_width(names, width, gap)
    rows = []
    for (s, d, orphan), name in zip(tree, names, strict=True):
        start, length = bar_cells(s.start_unix_ns, s.end_unix_ns, t0, t1 - t0, bar_w)
        rows.append(WaterfallRow(
            span=s, depth=d, orphan=orphan, label=cut(name, name_w), component=s.component,
            worker=short_worker(s.worker_hex), duration=fmt_duration(s.duration_ns), bar_start=start, bar_len=length,
        ))
    return Waterfall(tuple(rows), t0, t1, name_w, bar_w, gap)


def bar_text(row: WaterfallRow) -> str:
    return " " * row.bar_start + BAR * row.bar_len


def row_cells(row: WaterfallRow) -> tuple[str, str, str, str, str]:
    return (row.label, row.component, row.worker, row.duration, bar_text(row))


def text_lines(wf: Waterfall) -> list[str]:
    """The waterfall as plain lines (header first), none wider than the width it was laid out for."""
    sep = " " * wf.gap
    name_w, comp_w, worker_w, dur_w, _ = wf.widths

    def line(cells: tuple[str, str, str, str, str]) -> str:
        name, comp, worker, dur, bar = cells
        return sep.join((name.ljust(name_w), comp.ljust(comp_w), worker.ljust(worker_w), dur.rjust(dur_w), bar)).rstrip()

    header = line((COLUMNS[0], COLUMNS[1], COLUMNS[2], COLUMNS[3].rjust(dur_w), wf.scale_label()))
    return [header, *(line(row_cells(r)) for r in wf.rows)]


def trace_facts(request_id: str, trace_id: str, spans: list[Span]) -> list[tuple[str, str]]:
    """What the header above a waterfall says: (label, value) pairs in reading order."""
    model = next((str(s.attributes["model"]) for s in spans if s.attributes.get("model")), "")
    total = (max(s.end_unix_ns for s in spans) - min(s.start_unix_ns for s in spans)) if spans else 0
    workers: dict[str, str] = {}
    for s in spans:
        if s.worker_hex and s.component != "frontend":
            workers.setdefault(short_worker(s.worker_hex), str(s.attributes.get("role") or s.component))
    for s in spans:
        # A worker the frontend sent the request to but that gave no span: killed (a migration's
        # old worker, whose ring died with it), unreachable, or too old to serve ``traces``.
        routed = s.attributes.get("worker_id") if s.component == "frontend" else None
        if isinstance(routed, str) and routed:
            workers.setdefault(short_worker(routed), "no spans")
    errors = sum(1 for s in spans if s.status == STATUS_ERROR)
    migrated = any(s.name == SPAN_MIGRATION for s in spans)
    facts = [("request", printable(request_id)), ("trace", trace_id), ("model", printable(model) or "-"),
             ("took", fmt_duration(total)), ("spans", str(len(spans)))]
    if errors:
        facts.append(("errors", str(errors)))
    if migrated:
        facts.append(("migrated", "yes"))
    facts.append(("workers", ", ".join(f"{w} ({printable(r)})" for w, r in workers.items()) or "-"))
    return facts


def header_lines(request_id: str, trace_id: str, spans: list[Span], width: int = 80) -> list[str]:
    """The facts as lines of at most ``width`` cells, packed left to right."""
    lines: list[str] = []
    current = ""
    for label, value in trace_facts(request_id, trace_id, spans):
        item = f"{label} {value}"
        if current and len(current) + 2 + len(item) > width:
            lines.append(current)
            current = ""
        current = f"{current}  {item}" if current else item
    if current:
        lines.append(current)
    return [cut(line, width) for line in lines]


def render_text(request_id: str, trace_id: str, spans: list[Span], width: int = 80) -> str:
    """What ``dynamoctl trace`` prints: the facts, a blank line, the waterfall."""
    return "\n".join([*header_lines(request_id, trace_id, spans, width), "", *text_lines(layout(spans, width))]) + "\n"
