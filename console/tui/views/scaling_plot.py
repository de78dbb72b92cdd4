"""The Scaling view's plot: a pool's desired and ready replicas over time, against its load and
the SLA targets, as aligned sparklines that read at 80 columns.

One column is one planner interval (newest on the right), the same column in every row, so a
reader sees the load rise, the planner ask for more (``want``), the workers arrive (``ready``)
and the queue and TTFT fall back, in that order, or not. ``want`` and ``ready`` share one scale
(0 to the pool's budget), so the gap between them is the scale-up still in flight; a ``ready``
column short of ``want`` is yellow. TTFT and ITL are scaled so their target is always inside the
row, and a column over its target is red. The rows are built from ``PoolScaling.history``
(``console/state/scaling_history.py``); this module only draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Group
from rich.text import Text

from dynamod.console.present import fmt_count, fmt_ms_value, fmt_pct, fmt_rate
from dynamod.console.state.scaling import PoolScaling
from dynamod.console.state.scaling_history import ScalingSample

BARS = "▁▂▃▄▅▆▇█"
LABEL_WIDTH = 7  # "ready  "
VALUE_WIDTH = 20  # the newest figure, right of the plot
MIN_PLOT = 8


def spark(values: Sequence[float | None], hi: float) -> str:
    """One character per value on a 0..``hi`` scale; a value never measured is a blank, so a gap
    in the data is not drawn as an idle interval."""
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif hi <= 0:
            out.append(BARS[0])
        else:
            level = round(max(0.0, min(1.0, v / hi)) * (len(BARS) - 1))
            out.append(BARS[level])
    return "".join(out)


def plot_width(width: int) -> int:
    """Columns (intervals) the plot gets in a view ``width`` wide."""
    return max(MIN_PLOT, width - LABEL_WIDTH - VALUE_WIDTH - 3)


def _row(label: str, values: Sequence[float | None], hi: float, value: str, room: int,
         style_of: Callable[[int], str] | None = None) -> Text:
    line = Text(f"{label:<{LABEL_WIDTH}}", style="bold")
    pad = room - len(values)
    line.append(" " * pad)
    bars = spark(values, hi)
    for i, ch in enumerate(bars):
        line.append(ch, style=style_of(i) if style_of is not None else "cyan")
    line.append(f"  {value}")
    line.no_wrap = True
    return line


def _latency_row(label: str, values: list[float | None], target: float | None, room: int) -> Text:
    seen = [v for v in values if v is not None]
    hi = max([*seen, target or 0.0, 1.0])
    newest = next((v for v in reversed(values) if v is not None), None)
    text = fmt_ms_value(newest) + (f" / {fmt_ms_value(target)}" if target is not None else "")

    def style(i: int) -> str:
        v = values[i]
        return "bold red" if target is not None and v is not None and v > target else "green"

    return _row(label, values, hi, text, room, style)


def scaling_plot(p: PoolScaling, width: int) -> Group | None:
    """The pool's history as six aligned rows, or None before its first sampled interval."""
    if not p.history:
        return None
    room = plot_width(width - 2)
    samples: list[ScalingSample] = p.history[-room:]
    top = max([p.max_replicas or 0, *(s.desired for s in samples), *(s.ready for s in samples), 1])
    want = [float(s.desired) for s in samples]
    ready = [float(s.ready) for s in samples]
    rate = [s.request_rate for s in samples]
    queue = [s.waiting for s in samples]
    newest = samples[-1]
    lines = [Text(f"last {len(samples)} interval(s), newest right; replicas on a 0-{top} scale", style="dim",
                  no_wrap=True)]
    lines.append(_row("want", want, top, f"{newest.desired} (budget {p.min_replicas or 0}-{p.max_replicas or '?'})",
                      room, lambda i: "bold cyan"))
    lines.append(_row("ready", ready, top, str(newest.ready), room,
                      lambda i: "yellow" if ready[i] < want[i] else "cyan"))
    lines.append(_row("req/s", rate, max([r for r in rate if r is not None] + [0.0]), fmt_rate(newest.request_rate),
                      room, lambda i: "magenta"))
    kv = f" KV {fmt_pct(newest.kv_usage)}" if newest.kv_usage is not None else ""
    lines.append(_row("queue", queue, max([q for q in queue if q is not None] + [0.0]),
                      f"{fmt_count(newest.waiting)} waiting{kv}" if newest.waiting is not None else "-", room,
                      lambda i: "magenta"))
    lines.append(_latency_row("TTFT", [s.ttft_ms for s in samples], p.targets.get("ttft_ms"), room))
    lines.append(_latency_row("ITL", [s.itl_ms for s in samples], p.targets.get("itl_ms"), room))
    for line in lines:
        line.truncate(max(20, width - 2), overflow="ellipsis")
    return Group(*lines)
