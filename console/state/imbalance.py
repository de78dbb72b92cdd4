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
from dynamod.console.state.prom import PREFILL_LOCAL, PREFILL_REMOTE
from dynamod.console.state.records import EV_IMBALANCE, Imbalance, Worker

IMBALANCE_REPEAT_S = 300.0
STALE_LATENCY_S = 120.0  # a per-worker "last request" figure unchanged this long is history


class ImbalanceWatch:
    """The imbalances found at the last check, and when each was last reported."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self.current: list[Imbalance] = []
        self._reported: dict[tuple[str, int], float] = {}

    def update(self, workers: Iterable[Worker], now: float) -> None:
        found = detect_imbalances(workers, now)
        before = {(i.kind, i.instance_id) for i in self.current}
        for imb in found:
            key = (imb.kind, imb.instance_id)
            last = self._reported.get(key)
            if key not in before and (last is None or now - last >= IMBALANCE_REPEAT_S):
                self._reported[key] = now
                self._log.add_about(imb, EV_IMBALANCE, imb.message, severity="warning")
        self.current = found


def _peer_median(values: list[float], index: int) -> float:
    """Median of everyone but ``index``: with two or three workers the hot one must not pull the
    yardstick toward itself."""
    return statistics.median(values[:index] + values[index + 1 :])


def detect_imbalances(workers: Iterable[Worker], now: float | None = None) -> list[Imbalance]:
    """Names the hot or slow worker among ready peers serving the same model in one component.

    Each worker is compared with the median of its peers (itself excluded). Hot: KV usage at least
    25 points above that median (and above 50%), or a queue at least four deep and three times the
    peers' median. Slow: recent TTFT or ITL at least twice the peers' median and clearly above it in
    absolute terms (50 ms TTFT, 10 ms ITL), so noise on idle workers stays quiet; compared within
    one prefill population (local or remote, ``_slow_workers``); with ``now``, a figure that has not
    moved for ``STALE_LATENCY_S`` is an old request's and is left out.
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
        found.extend(_slow_workers(ns, component, peers, now))
    return found


def _latency_populations(w: Worker, attr: str, now: float | None = None) -> dict[str, float]:
    """The worker's figures by where the prompt was prefilled; a frontend without the ``prefill``
    label gives one figure, counted as local. Stale ones (see ``detect_imbalances``) are left out."""
    by: dict[str, float] = getattr(w.stats, f"{attr}_by")
    if by:
        changed = w.stats.latency_changed_at
        return {p: v for p, v in by.items()
                if now is None or now - changed.get(f"{attr}:{p}", now) <= STALE_LATENCY_S}
    value = getattr(w.stats, f"{attr}_s")
    return {PREFILL_LOCAL: float(value)} if value is not None else {}


def _slow_workers(ns: str, component: str, peers: list[Worker], now: float | None) -> list[Imbalance]:
    """Slow on TTFT or ITL against peers, like with like: a request prefilled by the worker itself
    (aggregated, or a decode worker's conditional or fallback prefill) is compared only with other
    local prefills, one prefilled by the prefill pool only with other remote ones. Otherwise one
    long local prefill on a decode worker reads as "498 ms vs peers 20 ms" and stays."""
    found: list[Imbalance] = []
    reported: set[tuple[int, str]] = set()
    for attr, label, floor in (("ttft", "TTFT", 0.05), ("itl", "ITL", 0.01)):
        figures = [(w, _latency_populations(w, attr, now)) for w in peers]
        mixed = len({p for _, by in figures for p in by}) > 1
        for population in (PREFILL_LOCAL, PREFILL_REMOTE):
            have = [(w, by[population]) for w, by in figures if population in by]
            if len(have) < 2:
                continue
            vals = [v for _, v in have]
            for i, (w, value) in enumerate(have):
                med = _peer_median(vals, i)
                if value >= 2 * med and value - med >= floor and (w.instance_id, label) not in reported:
                    reported.add((w.instance_id, label))
                    which = f" ({population} prefill)" if mixed else ""
                    found.append(Imbalance(
                        "slow", w.instance_id, ns, component,
                        f"slow worker {w.id_hex}: {label}{which} {value * 1000:.0f} ms vs peers {med * 1000:.0f} ms",
                    ))
    return found
