"""Turning ClusterState into rows and short strings: shared by the TUI views and dynamoctl.

Pure functions with no Textual import, so ``dynamoctl status`` prints the same figures the console
shows, and both are tested without a terminal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.failed import STATUS_FAILED, FailedEntry
from dynamod.console.state.pools import PoolSummary
from dynamod.console.state.records import STATUS_GONE, Worker, fmt_id
from dynamod.console.state.scaling import GlobalRouterPools, PoolScaling, describe_decision
from dynamod.console.state.tiers import TierFigures
from dynamod.console.state.transfers import TransferFigures
from dynamod.shared.protocol.planner import PlannerDecision
from dynamod.shared.security.printable import printable

SPARK_CHARS = "▁▂▃▄▅▆▇█"


def fmt_age(seconds: float | None) -> str:
    if seconds is None or seconds < 0 or math.isnan(seconds):
        return "-"
    if seconds < 60:
        return f"{int(seconds)}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}"
    return f"{int(seconds // 86400)}d"


def fmt_pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


# One letter per lower KV tier (vLLM's medium names), in the order blocks move down: host, disk.
TIER_LETTERS = {"CPU": "H", "DISK": "D"}
TIER_COLUMN = "TIER%"


def fmt_tiers(figures: dict[str, TierFigures]) -> str:
    """A worker's lower KV tiers' occupancy in a few characters (``H40 D12``: host 40% full, disk
    12%), only the tiers it has; "-" for a worker without any. The device's own usage is the KV
    column beside it."""
    if not figures:
        return "-"
    order = sorted(figures, key=lambda m: (list(TIER_LETTERS).index(m) if m in TIER_LETTERS else len(TIER_LETTERS), m))
    parts = []
    for medium in order:
        usage = figures[medium].usage
        parts.append(f"{TIER_LETTERS.get(medium, medium[:1])}{'-' if usage is None else f'{usage * 100:.0f}'}")
    return " ".join(parts)


def tier_records(figures: dict[str, TierFigures]) -> dict[str, dict[str, Any]] | None:
    """A worker's lower KV tiers for JSON, by medium (None for a worker without any)."""
    if not figures:
        return None
    return {
        medium: {
            "usage": round(f.usage, 4) if f.usage is not None else None,
            "blocks": f.blocks,
            "total_blocks": f.total_blocks,
            "hit_tokens": f.hit_tokens,
            "onboard_blocks_per_s": round(f.onboard_per_s, 2) if f.onboard_per_s is not None else None,
            "offload_blocks_per_s": round(f.offload_per_s, 2) if f.offload_per_s is not None else None,
        }
        for medium, f in figures.items()
    }


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    if ms < 10:
        return f"{ms:.1f}ms"
    if ms < 1000:
        return f"{ms:.0f}ms"
    return f"{seconds:.1f}s"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.1f}/s" if rate < 100 else f"{rate:.0f}/s"


def fmt_bytes_rate(rate: float | None) -> str:
    """Bytes per second in SI units, at most 7 characters (``1.5MB/s``, ``157MB/s``)."""
    if rate is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rate >= size:
            v = rate / size
            return f"{v:.1f}{unit}/s" if v < 10 else f"{v:.0f}{unit}/s"
    return f"{rate:.0f}B/s"


def fmt_ms_value(ms: float | None) -> str:
    """A figure already in milliseconds (transfer times), formatted like ``fmt_ms``."""
    return "-" if ms is None else fmt_ms(ms / 1000)


def fmt_count(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value < 10_000 else f"{value / 1000:.0f}k"


def sparkline(values: Sequence[float], width: int, scale_max: float | None = None) -> str:
    """The last ``width`` values as block characters scaled to ``scale_max`` (or their own max)."""
    tail = list(values)[-width:]
    if not tail:
        return " " * width
    top = scale_max if scale_max is not None else max(tail)
    if top <= 0:
        line = SPARK_CHARS[0] * len(tail)
    else:
        steps = len(SPARK_CHARS) - 1
        line = "".join(SPARK_CHARS[min(steps, max(0, round(v / top * steps)))] for v in tail)
    return line.rjust(width)


def worker_load_scale(workers: Iterable[Worker]) -> float:
    """One scale for every sparkline in a table, so the hot worker's line stands out."""
    top = 0.0
    for w in workers:
        if w.stats.history:
            top = max(top, max(w.stats.history))
    return top or 1.0


def transfer_record(fig: TransferFigures | None) -> dict[str, Any] | None:
    """A worker's KV transfer figures for JSON (None for workers that never took part in one)."""
    if fig is None or not fig.seen:
        return None
    return {
        "bytes_total": fig.bytes_total,
        "bytes_per_s": round(fig.bytes_per_s, 1) if fig.bytes_per_s is not None else None,
        "transfers": fig.transfers,
        "failures": fig.failures,
        "ms_p50": fig.p50_ms,
        "ms_p99": fig.p99_ms,
        "held_blocks": fig.held_blocks,
    }


def worker_record(
    w: Worker, now: float, transfer: TransferFigures | None = None, tiers: dict[str, TierFigures] | None = None
) -> dict[str, Any]:
    """Everything ``dynamoctl status --json`` prints for one instance (stable keys)."""
    st = w.stats
    return {
        "id": w.id_hex,
        "namespace": w.namespace,
        "component": w.component,
        "endpoint": "generate" if "generate" in w.endpoints else min(w.endpoints, default=""),
        "endpoints": sorted(w.endpoints),
        "role": w.role,
        "status": w.status,
        "model": w.model,
        "loras": sorted(w.loras),
        "node": w.node,
        "pid": w.pid,
        "age_s": round(now - w.started_at, 1) if w.started_at else None,
        "load": {
            "running": st.running,
            "waiting": st.waiting,
            "kv_usage": round(st.kv_usage, 4) if st.kv_usage is not None else None,
            "prefix_hit_rate": round(st.hit_rate, 4) if st.hit_rate is not None else None,
            "cached_blocks": st.cached_blocks,
            "ttft_s": st.ttft_s,
            "itl_s": st.itl_s,
            "routed": st.routed,
        }
        if st.loads or st.ttft_s is not None or st.routed
        else None,
        "kv_transfer": transfer_record(transfer),
        "kv_tiers": tier_records(tiers or {}),
    }


def failed_record(entry: FailedEntry, now: float) -> dict[str, Any]:
    """A worker ``dynamod up`` gave up on, with ``worker_record``'s keys (no id: it has no process)
    plus ``name`` and ``failed``: why it died, how often, where its log is."""
    r = entry.record
    return {
        "id": None,
        "name": r.name,
        "namespace": entry.namespace,
        "component": "",
        "endpoint": "",
        "endpoints": [],
        "role": entry.pool,
        "status": STATUS_FAILED,
        "model": "",
        "loras": [],
        "node": "",
        "pid": 0,
        "age_s": None,
        "load": None,
        "kv_transfer": None,
        "kv_tiers": None,
        "failed": {
            "reason": r.reason,
            "crashes": r.crashes,
            "window_s": r.window_s,
            "log": r.log,
            "supervisor_pid": r.supervisor_pid,
            "since_s": round(now - r.ts, 1) if r.ts else None,
            "restart": f"dynamoctl restart {r.name}",
        },
    }


def status_records(state: ClusterState, *, include_gone: bool = False) -> list[dict[str, Any]]:
    """Every instance, then every failed worker (``failed_record``)."""
    now = state.clock()
    out = [
        worker_record(w, now, state.transfers.figures(w.instance_id), state.tiers.figures(w.instance_id))
        for w in state.worker_list(workers_only=False, include_gone=include_gone)
    ]
    return out + [failed_record(e, now) for e in state.failed()]


POOL_COLUMNS = ("POOL", "READY", "RUN", "WAIT", "KV", "KV USED", "XFER/S", "XFER50", "XFER99", "FAIL", "HELD")


def pool_row(p: PoolSummary) -> tuple[str, ...]:
    """One pool as the TUI's pool strip and ``dynamoctl status`` show it. KV is the mean of the
    workers' usage; KV USED the pool's blocks in use over its blocks; transfer figures are "-"
    for a pool that never moved KV (agg)."""
    xfer = p.transfers_seen
    return (
        p.role,
        f"{p.ready}/{p.workers}",
        str(p.running),
        str(p.waiting),
        fmt_pct(p.kv_avg),
        f"{fmt_count(p.kv_used_blocks)}/{fmt_count(p.kv_total_blocks)}" if p.kv_total_blocks else "-",
        fmt_bytes_rate(p.bytes_per_s) if xfer else "-",
        fmt_ms_value(p.p50_ms) if xfer else "-",
        fmt_ms_value(p.p99_ms) if xfer else "-",
        fmt_count(p.failures) if xfer else "-",
        fmt_count(p.held_blocks) if xfer else "-",
    )


def pool_records(state: ClusterState) -> list[dict[str, Any]]:
    """Per-pool figures for JSON (``dynamoctl status --json --pools``)."""
    out = []
    for p in state.pools().values():
        out.append(
            {
                "pool": p.role,
                "workers": p.workers,
                "ready": p.ready,
                "running": p.running,
                "waiting": p.waiting,
                "kv_usage_avg": round(p.kv_avg, 4) if p.kv_avg is not None else None,
                "kv_used_blocks": p.kv_used_blocks,
                "kv_total_blocks": p.kv_total_blocks,
                "kv_transfer_bytes_per_s": round(p.bytes_per_s, 1) if p.bytes_per_s is not None else None,
                "kv_transfers": p.transfers,
                "kv_transfer_failures": p.failures,
                "kv_transfer_ms_p50": p.p50_ms,
                "kv_transfer_ms_p99": p.p99_ms,
                "kv_held_blocks": p.held_blocks,
                "worker_ids": [fmt_id(i) for i in p.worker_ids],
            }
        )
    return out


STATUS_COLUMNS = ("ID", "COMPONENT", "ROLE", "STATUS", "MODEL", "LORAS", "NODE", "PID", "RUN", "WAIT", "KV", "HIT", "AGE")


def status_table(state: ClusterState, *, include_gone: bool = False) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``dynamoctl status``'s columns and rows. A ``TIER%`` column follows KV when some worker
    has host or disk KV tiers; a cluster without them keeps the plain table."""
    now = state.clock()
    workers = state.worker_list(workers_only=False, include_gone=include_gone)
    tiers = {w.instance_id: state.tiers.figures(w.instance_id) for w in workers}
    with_tiers = any(tiers.values())
    columns = STATUS_COLUMNS
    if with_tiers:
        at = columns.index("KV") + 1
        columns = columns[:at] + (TIER_COLUMN,) + columns[at:]
    rows = []
    for w in workers:
        st = w.stats
        kv_less = w.is_encoder  # an encode worker's load record has no KV figures: "-", not 0
        has_load = bool(st.loads) and not kv_less
        row = [
            w.id_hex,
            f"{w.namespace}/{w.component}",
            w.role or "-",
            w.status,
            w.model or "-",
            ",".join(sorted(w.loras)) or "-",
            w.node or "-",
            str(w.pid or "-"),
            str(st.running) if has_load else "-",
            str(st.waiting) if has_load else "-",
            fmt_pct(None if kv_less else st.kv_usage),
        ]
        if with_tiers:
            row.append(fmt_tiers(tiers[w.instance_id]))
        row += [fmt_pct(None if kv_less else st.hit_rate), fmt_age(now - w.started_at if w.started_at else None)]
        rows.append(tuple(row))
    return columns, rows


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned columns for terminals and pipes (no colour, no box drawing). Every cell goes
    through ``printable``: names, messages and labels come from the network, and an escape
    sequence in one must show as text, not act on the operator's terminal."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(columns)).rstrip()]
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)


def cluster_counts(state: ClusterState) -> dict[str, int]:
    counts = {"workers": 0, "ready": 0, "draining": 0, "sleeping": 0, "gone": 0, "others": 0,
              "failed": len(state.failed())}
    for w in state.workers.values():
        if w.is_worker:
            counts["workers"] += w.status != STATUS_GONE
            if w.status in counts:
                counts[w.status] += 1
        elif w.gone_at is None:
            counts["others"] += 1  # frontends, routers, planners
    return counts


# -- scaling ---------------------------------------------------------------------------------------

# REQ/S, QUEUE, ISL, OSL, TTFT and ITL are live: the planner's last interval, from its status record
# (``PoolScaling.observed``/``load``); its prediction for the next one is in the JSON and the view's facts.
SCALING_COLUMNS = ("POOL", "PLANNER", "READY", "WANT", "OVERRIDE", "BUDGET", "REQ/S", "QUEUE", "ISL", "OSL", "TTFT",
                   "ITL", "LAST")


def fmt_value(value: float | None) -> str:
    """A predicted figure (tokens, counts): whole numbers without decimals."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.1f}"


def fmt_sla(measured_ms: float | None, target_ms: float | None) -> str:
    """Measured against target in one cell: ``45/200ms``; just ``45ms`` without a target."""
    if target_ms is None:
        return fmt_ms_value(measured_ms)
    got = "-" if measured_ms is None else fmt_value(measured_ms)
    return f"{got}/{fmt_value(target_ms)}ms"


def sla_breached(measured_ms: float | None, target_ms: float | None) -> bool:
    return measured_ms is not None and target_ms is not None and measured_ms > target_ms


def fmt_budget(p: PoolScaling) -> str:
    if p.min_replicas is None and not p.max_replicas:
        return "-"
    return f"{p.min_replicas or 0}-{p.max_replicas or '?'}"


def scaling_row(p: PoolScaling) -> tuple[str, ...]:
    """One pool as ``dynamoctl planner status`` prints it (the Scaling view fits a subset)."""
    last = p.last
    planner = (p.planner + (" dry" if p.dry_run else "")) if p.planner else "-"
    return (
        p.key,
        planner,
        f"{p.ready}/{p.live}",
        str(p.desired) if p.desired is not None else "-",
        str(p.override.replicas) if p.override is not None else "-",
        fmt_budget(p),
        fmt_rate(p.observed.get("request_rate")),
        fmt_count(p.load.get("waiting")),
        fmt_value(p.observed.get("isl")),
        fmt_value(p.observed.get("osl")),
        fmt_sla(p.ttft_ms, p.targets.get("ttft_ms")),
        fmt_sla(p.itl_ms, p.targets.get("itl_ms")),
        f"{last.action} {last.reason}" if last is not None else (f"{p.last_action} {p.last_reason}"
                                                                  if p.last_action else "-"),
    )


def scaling_record(p: PoolScaling) -> dict[str, Any]:
    """One pool for JSON (``dynamoctl planner status --json``)."""
    return {
        "namespace": p.namespace,
        "pool": p.pool,
        "component": p.component,
        "planner": p.planner or None,
        "connector": p.connector or None,
        "dry_run": p.dry_run,
        "ready": p.ready,
        "live": p.live,
        "current": p.current,
        "desired": p.desired,
        "override": msgspec.to_builtins(p.override) if p.override is not None else None,
        "target": p.target,
        "min_replicas": p.min_replicas,
        "max_replicas": p.max_replicas,
        "scaled": p.scaled,
        "predicted": p.predicted,
        "observed": p.observed,
        "load": p.load,
        "targets": p.targets,
        "measured": {"ttft_ms": p.ttft_ms, "itl_ms": p.itl_ms, "ttft_p99_ms": p.measured.ttft_p99,
                     "itl_p99_ms": p.measured.itl_p99},
        "last_decision": msgspec.to_builtins(p.last) if p.last is not None else None,
    }


def global_router_line(g: GlobalRouterPools) -> str:
    """``global-router 7a1b.. -> dynamo: 4 ready, planned; dynamo-large: empty``."""
    parts = []
    for ns in g.pools:
        n = g.ready.get(ns, 0)
        parts.append(f"{ns}: {f'{n} ready' if n else 'empty'}{', planned' if g.planned.get(ns) else ''}")
    status = f" [{g.status}]" if g.status != "ready" else ""
    return f"global-router {fmt_id(g.instance_id)}{status} -> " + ("; ".join(parts) or "no pools labelled")


def decision_line(d: PlannerDecision) -> str:
    """A decision for ``dynamoctl planner decisions``: wall time, then ``describe_decision``."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(d.ts)) if d.ts else "-"
    return f"{stamp} #{d.decision_id} {describe_decision(d)}"
