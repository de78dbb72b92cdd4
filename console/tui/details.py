"""The full text of one table row, for the detail pane Enter opens (``DetailScreen``).

At 80 columns the Events message, the Router WHY and the Scaling DETAIL are cut with an ellipsis;
these build the uncut text (wrapped by the pane) with the fields the row had no room for. Pure
functions of the state's records, so they are tested without a screen. Every string that came
from the network goes through ``printable``.
"""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.text import Text

from dynamod.console.present import fmt_age
from dynamod.console.state.decisions import HeardDecision
from dynamod.console.state.records import ClusterEvent, fmt_id, fmt_num
from dynamod.console.state.scaling import PoolScaling
from dynamod.console.tui.pool_facts import pool_facts
from dynamod.console.tui.style import severity_text
from dynamod.shared.protocol.supervisor import FailedWorker
from dynamod.shared.security.printable import printable


def _stamp(ts: float, now: float) -> str:
    """UTC, so a pane reads the same on every operator's host (and in every snapshot)."""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(ts))} ({fmt_age(now - ts)} ago)"


def _field(text: Text, name: str, value: str) -> None:
    text.append(f"{name} ", style="dim")
    text.append(value)
    text.append("   ")


def event_detail(ev: ClusterEvent, now: float) -> tuple[str, RenderableType]:
    head = Text()
    _field(head, "at", _stamp(ev.ts, now))
    _field(head, "kind", ev.kind)
    _field(head, "severity", ev.severity)
    where = Text()
    _field(where, "where", printable(f"{ev.namespace}/{ev.component}") if ev.namespace or ev.component else "-")
    _field(where, "instance", fmt_id(ev.instance_id))
    return f"event: {ev.kind}", Group(head, where, Text(""), severity_text(printable(ev.message), ev.severity))


def decision_detail(d: HeardDecision, now: float) -> tuple[str, RenderableType]:
    head = Text()
    _field(head, "at", _stamp(d.ts, now))
    _field(head, "stage", d.stage)
    _field(head, "model", printable(d.model) if d.model else "-")
    ids = Text()
    _field(ids, "request", printable(d.request_id) if d.request_id else "-")
    _field(ids, "namespace", printable(d.namespace) or "-")
    parts: list[RenderableType] = [head, ids, Text(""), Text(printable(d.explanation()))]
    info = d.disagg
    if info is not None:
        disagg = Text("\nprefill: ", style="dim")
        disagg.append(f"{info.mode} (policy {printable(info.policy) or '-'}, reason {printable(info.reason) or '-'})")
        if info.prefill_worker_id is not None:
            disagg.append(f" on {fmt_id(info.prefill_worker_id)}")
        if info.detail:
            disagg.append(f"\n{printable(info.detail)}")
        parts.append(disagg)
    if d.candidates:
        cands = Text("\ncandidates (cost = prefill + decode blocks, lowest wins):\n", style="dim")
        for c in sorted(d.candidates, key=lambda c: c.cost):
            mark = "▶ " if c.worker_id == d.worker_id and c.dp_rank == d.dp_rank else "  "
            cands.append(f"{mark}{fmt_id(c.worker_id)}/dp{c.dp_rank}  cost {fmt_num(c.cost)} = prefill "
                         f"{fmt_num(c.prefill_blocks)} + decode {fmt_num(c.decode_blocks)}  overlap "
                         f"{fmt_num(c.overlap_blocks)}\n", style="bold" if mark.strip() else "")
        parts.append(cands)
    parts.append(Text("\nEnter opens the chosen worker, Esc goes back.", style="dim"))
    return f"routing decision: {fmt_id(d.worker_id)}", Group(*parts)


def pool_detail(p: PoolScaling, now: float) -> tuple[str, RenderableType]:
    """The pool's facts and every decision the console holds, with its full detail."""
    parts: list[RenderableType] = [pool_facts(p, 10_000)]
    if p.decisions:
        parts.append(Text("\ndecisions (newest first):", style="dim"))
    for d in p.decisions:
        line = Text(f"{fmt_age(now - d.ts):>4}  ")
        line.append(d.action, style="" if d.action == "hold" else "bold")
        size = f"{d.current}->{d.desired}" if d.desired != d.current else str(d.current)
        line.append(f"  {size}  {printable(d.reason)}")
        if d.detail:
            line.append(f": {printable(d.detail)}")
        if d.error:
            line.append(f"  failed: {printable(d.error)}", style="bold red")
        parts.append(line)
    return f"pool {printable(p.key)}", Group(*parts)


def failed_worker_detail(namespace: str, f: FailedWorker, now: float) -> tuple[str, RenderableType]:
    """A worker ``dynamod up`` gave up on: why, where its log is, how to try it again."""
    text = Text()
    _field(text, "pool", printable(f.pool) or "-")
    _field(text, "namespace", printable(namespace))
    text.append("\n")
    if f.ts:
        _field(text, "given up at", _stamp(f.ts, now))
        text.append("\n")
    text.append("last death ", style="dim")
    text.append(printable(f.reason) or "-", style="bold red")
    text.append(f"\n{f.crashes} deaths within {f.window_s:g}s: not restarted (crash loop)\n")
    text.append("log ", style="dim")
    text.append(f"{printable(f.log) or '-'}\n")
    if f.supervisor_pid:
        text.append(f"supervisor pid {f.supervisor_pid}\n", style="dim")
    text.append(f"\n`dynamoctl restart {printable(f.name)}` starts it again with a fresh crash count.")
    return f"{printable(f.name)}: failed", text
