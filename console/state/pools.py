"""Per-pool load: the agg, prefill and decode workers each summed as one pool.

With disaggregated serving the question an operator asks first is which pool is the bottleneck:
a prefill pool with a queue and a decode pool at 30% KV calls for a different fix than the
reverse. Pools are keyed by role (``Worker.pool``), not by component, because Dynamo puts decode
and agg workers in the same ``backend`` component.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from dynamod.console.state.records import POOL_ORDER, Worker
from dynamod.console.state.transfers import KvTransferTracker


@dataclass(slots=True)
class PoolSummary:
    """One pool's load and KV transfer figures over its live workers."""

    role: str
    workers: int = 0  # live (not gone)
    ready: int = 0
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0  # summed over the pool
    kv_total_blocks: int = 0
    kv_avg: float | None = None  # mean of the workers' KV usage
    bytes_per_s: float | None = None  # summed transfer rate (None: no worker gave one yet)
    transfers: int = 0
    failures: int = 0
    held_blocks: int = 0
    p50_ms: float | None = None  # median of the workers' p50
    p99_ms: float | None = None  # the worst worker's p99
    worker_ids: list[int] = field(default_factory=list)

    @property
    def kv_usage(self) -> float | None:
        """Pool-wide usage: blocks in use over blocks the pool has (the "sum" view of KV)."""
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else None

    @property
    def transfers_seen(self) -> bool:
        return bool(self.transfers or self.failures or self.held_blocks or self.bytes_per_s)


def summarize_pools(workers: Iterable[Worker], transfers: KvTransferTracker) -> dict[str, PoolSummary]:
    """Pools in ``POOL_ORDER`` (then any other role), each over its live engine workers."""
    out: dict[str, PoolSummary] = {}
    usages: dict[str, list[float]] = {}
    p50s: dict[str, list[float]] = {}
    for w in workers:
        if not w.is_worker or w.gone_at is not None:
            continue
        pool = out.get(w.pool)
        if pool is None:
            pool = out[w.pool] = PoolSummary(w.pool)
        pool.workers += 1
        pool.ready += w.status == "ready"
        pool.worker_ids.append(w.instance_id)
        st = w.stats
        if st.loads:
            pool.running += st.running
            pool.waiting += st.waiting
            for m in st.loads.values():
                pool.kv_used_blocks += round(m.kv_usage * m.total_blocks)
                pool.kv_total_blocks += m.total_blocks
            usage = st.kv_usage
            if usage is not None:
                usages.setdefault(w.pool, []).append(usage)
        fig = transfers.figures(w.instance_id)
        if fig is None:
            continue
        pool.transfers += fig.transfers
        pool.failures += fig.failures
        pool.held_blocks += fig.held_blocks
        if fig.bytes_per_s is not None:
            pool.bytes_per_s = (pool.bytes_per_s or 0.0) + fig.bytes_per_s
        if fig.p50_ms is not None:
            p50s.setdefault(w.pool, []).append(fig.p50_ms)
        if fig.p99_ms is not None:
            pool.p99_ms = max(pool.p99_ms or 0.0, fig.p99_ms)
    for role, pool in out.items():
        if usages.get(role):
            pool.kv_avg = sum(usages[role]) / len(usages[role])
        if p50s.get(role):
            pool.p50_ms = statistics.median(p50s[role])
    rank = {role: i for i, role in enumerate(POOL_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def is_disaggregated(pools: dict[str, PoolSummary]) -> bool:
    """A cluster with a prefill or decode pool: the views then show roles and transfers."""
    return any(role != "agg" for role in pools)
