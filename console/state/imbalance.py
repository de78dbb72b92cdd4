"""Imbalance detection: the hot or slow worker among peers that should be doing the same work.

``detect_imbalances`` is a pure function of the workers' figures; ``ImbalanceWatch`` keeps the
current findings for the Workers view's banner and reports each worker turning hot or slow to the
event log at most once per worker and kind per ``IMBALANCE_REPEAT_S``, so a flapping worker does
not flood it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from dynamod.console.state.event_log import EventLog
from dynamod.console.state.records import EV_IMBALANCE, Imbalance, Worker

IMBALANCE_REPEAT_S = 300.0


class ImbalanceWatch:
    """The imbalances found at the last check, and when each was last reported."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self.current: list[Imbalance] = []
        self._reported: dict[tuple[str, int], float] = {}

    def update(self, workers: Iterable[Worker], now: float) -> None:
        found = detect_imbalances(workers)
        before = {(i.kind, i.instance_id) for i in self.current}
        for imb in found:
            key = (imb.kind, imb.instance_id)
            last = self._reported.get(key)
            if key not in before and (last is None or now - last >= IMBALANCE_REPEAT_S):
                self._reported[key] = now
                self._log.add(
                    EV_IMBALANCE,
                    imb.message,
                    namespace=imb.namespace,
                    component=imb.component,
                    instance_id=imb.instance_id,
                    severity="warning",
                )
        self.current = found


def _peer_median(values: list[float], index: int) -> float:
    """Median of everyone but ``index``: with two or three workers the hot one must not pull the
    yardstick toward itself."""
    return statistics.median(values[:index] + values[index + 1 :])


def detect_imbalances(workers: Iterable[Worker]) -> list[Imbalance]:
    """Names the hot or slow worker among ready peers serving the same model in one component.

    Each worker is compared with the median of its peers (itself excluded). Hot: KV usage at least
    25 points above that median (and above 50%), or a queue at least four deep and three times the
    peers' median. Slow: recent TTFT or ITL at least twice the peers' median and clearly above it in
    absolute terms (50 ms TTFT, 10 ms ITL), so noise on idle workers stays quiet.
    """
    groups: dict[tuple[str, str, str], list[Worker]] = {}
    for w in workers:
        if w.gone_at is None and w.status == "ready" and w.is_worker and w.stats.loads:
            groups.setdefault((w.namespace, w.component, w.model), []).append(w)
    found: list[Imbalance] = []
    for (ns, component, _model), peers in sorted(groups.items()):
        if len(peers) < 2:
            continue
        kv = [w.stats.kv_usage or 0.0 for w in peers]
        waits = [float(w.stats.waiting) for w in peers]
        for i, w in enumerate(peers):
            med_kv = _peer_median(kv, i)
            med_wait = _peer_median(waits, i)
            reasons = []
            if kv[i] >= 0.5 and kv[i] - med_kv >= 0.25:
                reasons.append(f"KV {kv[i] * 100:.0f}% vs peers {med_kv * 100:.0f}%")
            if waits[i] >= 4 and waits[i] >= 3 * max(med_wait, 1.0):
                reasons.append(f"{waits[i]:.0f} waiting vs peers {med_wait:g}")
            if reasons:
                found.append(Imbalance("hot", w.instance_id, ns, component, f"hot worker {w.id_hex}: " + ", ".join(reasons)))
        for attr, label, floor in (("ttft_s", "TTFT", 0.05), ("itl_s", "ITL", 0.01)):
            have = [w for w in peers if getattr(w.stats, attr) is not None]
            if len(have) < 2:
                continue
            vals = [float(getattr(w.stats, attr)) for w in have]
            for i, w in enumerate(have):
                med = _peer_median(vals, i)
                if vals[i] >= 2 * med and vals[i] - med >= floor:
                    found.append(
                        Imbalance(
                            "slow",
                            w.instance_id,
                            ns,
                            component,
                            f"slow worker {w.id_hex}: {label} {vals[i] * 1000:.0f} ms vs peers {med * 1000:.0f} ms",
                        )
                    )
    return found
