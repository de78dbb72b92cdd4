"""KV tier figures per worker (host memory, disk), derived from ``kv_metrics``' ``kv_tiers``.

Workers with offloading publish, per lower tier, its occupancy and cumulative counters (prompt
tokens served from it, blocks onboarded back to the device, blocks offloaded into it); an operator
wants occupancy and rates, taken as counter_rates.py says (a window of the publisher's messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.console.state.counter_rates import CounterRates
from dynamod.shared.protocol.load import LoadMetrics


@dataclass(slots=True)
class TierFigures:
    """One lower tier of one worker, summed over its data-parallel ranks."""

    blocks: int = 0
    total_blocks: int = 0
    hit_tokens: int = 0
    onboard_per_s: float | None = None  # blocks/s back to the device; None until two messages
    offload_per_s: float | None = None  # blocks/s into this tier

    @property
    def usage(self) -> float | None:
        return self.blocks / self.total_blocks if self.total_blocks else None


class KvTierTracker:
    """Per-worker, per-tier figures, updated on every load message (only workers with tiers pay)."""

    def __init__(self) -> None:
        self._latest: dict[int, dict[int, LoadMetrics]] = {}  # worker id -> dp rank -> message
        # (worker id, dp rank, medium) -> its cumulative (onboarded, offloaded) blocks
        self._series: dict[tuple[int, int, str], CounterRates] = {}
        self._figures: dict[int, dict[str, TierFigures]] = {}

    def observe(self, m: LoadMetrics, now: float) -> None:
        tiers = m.kv_tiers
        if not tiers and m.worker_id not in self._latest:
            return
        t = m.ts if m.ts > 0 else now
        for medium, tier in (tiers or {}).items():
            series = self._series.get((m.worker_id, m.dp_rank, medium))
            if series is None:
                series = self._series[(m.worker_id, m.dp_rank, medium)] = CounterRates()
            series.add(t, tier.onboarded_blocks, tier.offloaded_blocks)
        ranks = self._latest.setdefault(m.worker_id, {})
        ranks[m.dp_rank] = m
        self._figures[m.worker_id] = self._combine(m.worker_id, ranks)

    def figures(self, worker_id: int) -> dict[str, TierFigures]:
        """Medium -> figures (empty when the worker has no lower tiers)."""
        return self._figures.get(worker_id, {})

    def forget(self, worker_id: int) -> None:
        self._latest.pop(worker_id, None)
        self._figures.pop(worker_id, None)
        for key in [k for k in self._series if k[0] == worker_id]:
            del self._series[key]

    def retain(self, worker_ids: set[int]) -> None:
        for wid in [w for w in self._latest if w not in worker_ids]:
            self.forget(wid)

    def _combine(self, worker_id: int, ranks: dict[int, LoadMetrics]) -> dict[str, TierFigures]:
        out: dict[str, TierFigures] = {}
        for rank, m in ranks.items():
            for medium, tier in (m.kv_tiers or {}).items():
                f = out.get(medium)
                if f is None:
                    f = out[medium] = TierFigures()
                f.blocks += tier.blocks
                f.total_blocks += tier.total_blocks
                f.hit_tokens += tier.hit_tokens
                series = self._series.get((worker_id, rank, medium))
                rates = series.rates() if series is not None else None
                if rates is not None:
                    f.onboard_per_s = (f.onboard_per_s or 0.0) + rates[0]
                    f.offload_per_s = (f.offload_per_s or 0.0) + rates[1]
        return out
