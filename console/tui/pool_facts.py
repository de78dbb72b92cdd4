"""The selected pool's facts in four lines: drawn under the Scaling view's table and at the top of
the pool's detail screen, so it sits below both (neither imports the other)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from dynamod.console.present import fmt_budget, fmt_ms_value, fmt_rate, fmt_value, sla_breached
from dynamod.console.state.scaling import PoolScaling
from dynamod.shared.security.printable import printable


def line(text: str, width: int, style: str = "") -> Text:
    """One line of network text, sanitised and cut to ``width``."""
    out = Text(printable(text), style=style, no_wrap=True, overflow="ellipsis")
    out.truncate(width, overflow="ellipsis")
    return out


def _sla_text(name: str, p50: float | None, p99: float | None, target: float | None) -> Text:
    """``TTFT 45ms/200ms ok (p99 400ms)``: the live figure against the target, red when over."""
    breached = sla_breached(p50, target)
    out = Text(f"{name} ")
    out.append(fmt_ms_value(p50) + (f"/{fmt_ms_value(target)}" if target is not None else ""),
               style="bold red" if breached else "")
    if target is not None:
        out.append(" over" if breached else (" ok" if p50 is not None else " ?"), style="bold red" if breached else "green")
    if p99 is not None:
        out.append(f" (p99 {fmt_ms_value(p99)})")
    return out


def pool_facts(p: PoolScaling, width: int) -> Group:
    """The selected pool in four lines (each cut to ``width``): sizes, override, prediction, SLA."""
    room = max(20, width - 2)
    head = f"{p.key} ({p.component})  "
    if p.planner:
        head += f"{p.planner} planner, {p.connector or '?'} connector{', DRY RUN' if p.dry_run else ''}"
    else:
        head += "no planner"
    sizes = f"ready {p.ready} of {p.live}"
    if p.current is not None or p.desired is not None:
        sizes += f"  planner counts {p.current if p.current is not None else '-'}, wants {p.desired if p.desired is not None else '-'}"
    sizes += f"  budget {fmt_budget(p)}"
    if p.scaled is not None:
        sizes += f"  scaled to {p.scaled}"
    if p.override is not None:
        o = p.override
        over = line(f"override {o.replicas}" + (f" by {o.set_by}" if o.set_by else "") + (f": {o.reason}" if o.reason else "")
                     + "  (x clears)", room, "bold yellow")
    else:
        over = line("no override (r sets one)", room, "dim")
    pred = p.predicted
    predicted = (f"predicted {fmt_rate(pred.get('request_rate'))}  ISL {fmt_value(pred.get('isl'))}  "
                 f"OSL {fmt_value(pred.get('osl'))}") if pred else "predicted -"
    sla = _sla_text("TTFT", p.ttft_ms, p.measured.ttft_p99, p.targets.get("ttft_ms"))
    sla.append("  ")
    sla.append_text(_sla_text("ITL", p.itl_ms, p.measured.itl_p99, p.targets.get("itl_ms")))
    sla.truncate(room, overflow="ellipsis")
    sla.no_wrap = True
    return Group(line(head, room, "bold"), line(sizes, room), over, line(predicted, room), sla)
