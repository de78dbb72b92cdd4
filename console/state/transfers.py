"""KV transfer figures per worker, derived from the transfer fields of ``kv_metrics``.

Workers publish cumulative counters (bytes moved, transfers, failures) and window percentiles of
transfer time; an operator wants a rate, taken as counter_rates.py says (over a window of the
publisher's messages, never across a restart).

A decode worker counts what it pulled and a prefill worker what was read from it, so the same bytes
appear once in each pool; pool sums are per pool, never added across pools.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dynamod.console.state.counter_rates import CounterRates
from dynamod.shared.protocol.load import LoadMetrics


@dataclass(slots=True)
class TransferFigures:
    """What one worker (all its data-parallel ranks) reports about KV transfers."""

    bytes_total: int = 0
    transfers: int = 0
    failures: int = 0
    held_blocks: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    bytes_per_s: float | None = None  # None until two messages give a rate

    @property
    def seen(self) -> bool:
        """Whether the worker ever took part in a transfer (agg workers never do)."""
        return bool(self.transfers or self.bytes_total or self.failures or self.held_blocks)


@dataclass(slots=True)
class _RankSeries:
    """One data-parallel rank's latest transfer fields and its cumulative (bytes, transfers);
    the transfer count is sampled too, so a restart is seen even before any byte moved."""

    latest: LoadMetrics
    counters: CounterRates = field(default_factory=CounterRates)

    def add(self, m: LoadMetrics, t: float) -> None:
        self.latest = m
        self.counters.add(t, m.kv_transfer_bytes, m.kv_transfers)

    def rate(self) -> float | None:
        """Bytes per second over the window."""
        rates = self.counters.rates()
        return rates[0] if rates is not None else None


class KvTransferTracker:
    """Per-worker transfer figures, updated on every load message (a hot path: no scans)."""

    def __init__(self) -> None:
        self._series: dict[int, dict[int, _RankSeries]] = {}  # worker id -> dp rank -> series
        self._figures: dict[int, TransferFigures] = {}

    def observe(self, m: LoadMetrics, now: float) -> None:
        """One ``kv_metrics`` message; ``now`` stands in when the publisher sent no timestamp."""
        ranks = self._series.setdefault(m.worker_id, {})
        series = ranks.get(m.dp_rank)
        if series is None:
            series = ranks[m.dp_rank] = _RankSeries(m)
        series.add(m, m.ts if m.ts > 0 else now)
        self._figures[m.worker_id] = _combine(ranks.values())

    def figures(self, worker_id: int) -> TransferFigures | None:
        return self._figures.get(worker_id)

    def forget(self, worker_id: int) -> None:
        """The worker is gone: its last rate is no longer true."""
        self._series.pop(worker_id, None)
        self._figures.pop(worker_id, None)

    def retain(self, worker_ids: set[int]) -> None:
        for wid in [w for w in self._series if w not in worker_ids]:
            self.forget(wid)


def _combine(ranks: Iterable[_RankSeries]) -> TransferFigures:
    """Sums the counters over ranks; the percentiles are the worst rank's (a p99 cannot be summed,
    and the slow rank is the one an operator must see)."""
    out = TransferFigures()
    rate: float | None = None
    for series in ranks:
        m = series.latest
        out.bytes_total += m.kv_transfer_bytes
        out.transfers += m.kv_transfers
        out.failures += m.kv_transfer_failures
        out.held_blocks += m.kv_held_blocks
        # 0 means "not measured" (a prefill worker serving reads may not time them), not 0 ms.
        if m.kv_transfer_ms_p50 > 0:
            out.p50_ms = max(out.p50_ms or 0.0, m.kv_transfer_ms_p50)
        if m.kv_transfer_ms_p99 > 0:
            out.p99_ms = max(out.p99_ms or 0.0, m.kv_transfer_ms_p99)
        r = series.rate()
        if r is not None:
            rate = (rate or 0.0) + r
    out.bytes_per_s = rate
    return out
