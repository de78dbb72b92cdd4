"""The seam between the planner's policies (pure: observations in, replica counts out) and the
daemon that feeds them (event-plane load, frontend or Prometheus metrics, discovery counts) and
acts on what they return. The same policies run in the daemon and inside ``dynamod replay
--planner``, on the simulated clock: nothing here reads a clock, a socket or a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from dynamod.shared.protocol.planner import ACTION_HOLD


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's last load report (``LoadMetrics`` on ``kv_metrics``), as the load planner uses it."""

    worker_id: int
    kv_usage: float  # 0..1
    num_waiting: int
    num_running: int
    active_prefill_tokens: int
    active_decode_blocks: int
    total_blocks: int
    # Seconds since the worker became ready (None: unknown). A worker in its first interval is
    # cold (empty prefix cache, routers only starting to send to it): its load says nothing yet
    # about what the pool can carry, so capacity and scale-down evidence leave it out.
    ready_for_s: float | None = None
    prefix_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens since the worker started


@dataclass(frozen=True, slots=True)
class TrafficSample:
    """What the frontends saw over the last interval (SLA planner input). ``None`` where nothing
    was measured (no requests finished in the interval)."""

    duration_s: float
    num_requests: float  # requests that arrived in the interval (finished + growth of in-flight)
    isl: float | None  # mean prompt tokens
    osl: float | None  # mean output tokens
    ttft_ms: float | None  # mean time to first token
    itl_ms: float | None  # mean inter-token latency
    # Latency distributions, as the frontends' Prometheus histograms give them: cumulative
    # ``(upper bound ms, count)`` pairs, the last bound ``inf``. They say how many requests
    # (TTFT) or token gaps (ITL) missed a target, which a mean hides (``fraction_over``).
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    itl_buckets: tuple[tuple[float, float], ...] = ()
    osl_buckets: tuple[tuple[float, float], ...] = ()  # output tokens of the finished requests
    inflight: float | None = None  # requests in flight at the end of the interval
    # Prompt tokens the workers found in their KV cache over the interval's finished requests
    # (``dynamo_frontend_cached_tokens`` / ``..._prompt_tokens``): the prefill work a prompt
    # token really costs. None when nothing finished.
    hit_rate: float | None = None


def fraction_over(buckets: tuple[tuple[float, float], ...], threshold: float, *, interpolate: bool = False) -> float | None:
    """The share of a histogram's observations above ``threshold``; None when empty.

    By default only buckets whose lower bound is at or above the threshold count: a lower bound
    on the misses, never a phantom one (the frontend's TTFT buckets jump from 1 s to 2.5 s, and
    a large prompt's honest 1.3 s TTFT must not read as a third of a miss). ``interpolate``
    spreads a bucket's count linearly instead (Prometheus' ``histogram_quantile`` assumption)."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if threshold < bound:
            if not interpolate or bound == float("inf"):
                below = count if lo_bound < threshold else lo_count
            else:
                below = lo_count + (count - lo_count) * (threshold - lo_bound) / (bound - lo_bound)
            return max(0.0, min(1.0, 1.0 - below / total))
        lo_bound, lo_count = bound, count
    return max(0.0, 1.0 - lo_count / total)


def _bucket_means(buckets: tuple[tuple[float, float], ...], threshold: float) -> tuple[float, float, float]:
    """(mean of the observations at or under ``threshold``, mean of those over it, share over),
    each bucket's observations at its midpoint (the +Inf bucket at twice its lower bound)."""
    under = over = n_under = n_over = 0.0
    lo, prev = 0.0, 0.0
    for bound, count in buckets:
        n = count - prev
        mid = 2.0 * lo if bound == float("inf") else (lo + bound) / 2.0
        if bound <= threshold:
            under, n_under = under + n * mid, n_under + n
        else:
            over, n_over = over + n * max(mid, threshold), n_over + n
        lo, prev = bound, count
    total = n_under + n_over
    return (under / n_under if n_under else 0.0, over / n_over if n_over else threshold,
            n_over / total if total else 0.0)


def request_itl_miss(itl_buckets: tuple[tuple[float, float], ...], osl_buckets: tuple[tuple[float, float], ...],
                     target_ms: float) -> float | None:
    """The share of requests whose *mean* ITL misses ``target_ms``, estimated from the gap and
    output-length histograms (what a frontend exposes; it keeps no per-request mean).

    A gap is long (over the target, mean ``c``) with probability ``p`` and short (mean ``d``)
    otherwise, independently; a request of ``k`` gaps misses when more than
    ``k (target - d) / (c - d)`` of them are long: a binomial tail, weighted by how many requests
    have ``k`` gaps (each output bucket at its midpoint). One long gap spoils a short request,
    while a long one averages many away: the gap share alone cannot tell 1% from 20% of requests."""
    if not itl_buckets or not osl_buckets or osl_buckets[-1][1] <= 0:
        return None
    d, c, p = _bucket_means(itl_buckets, target_ms)
    if p <= 0.0:
        return 0.0
    if c <= d:
        return p
    allowed = (target_ms - d) / (c - d)  # share of a request's gaps that may be long
    return binomial_request_miss(osl_classes(osl_buckets), p, allowed)


def osl_classes(osl_buckets: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """(output tokens, weight) per bucket of a cumulative output-length histogram: each bucket
    at its midpoint (the +Inf bucket at twice its lower bound), weights summing to 1."""
    if not osl_buckets or osl_buckets[-1][1] <= 0:
        return []
    total = osl_buckets[-1][1]
    out, lo, prev = [], 0.0, 0.0
    for bound, count in osl_buckets:
        n = count - prev
        lo_b, prev, lo = lo, count, bound
        if n > 0:
            out.append((2.0 * lo_b if bound == float("inf") else (lo_b + bound) / 2.0, n / total))
    return out


def exponential_osl_classes(mean_osl: float, classes: int = 10) -> list[tuple[float, float]]:
    """Output lengths when only their mean is known: an exponential distribution's decile
    midpoints (the short requests, which one long gap spoils, are not averaged away)."""
    mean = max(mean_osl, 1.0)
    return [(max(1.0, -mean * math.log(1.0 - (i + 0.5) / classes)), 1.0 / classes) for i in range(classes)]


def binomial_request_miss(classes: list[tuple[float, float]], p: float, allowed: float) -> float:
    """The share of requests whose mean ITL misses when each gap is independently long with
    probability ``p`` and a request may have at most ``allowed`` of its gaps long: per output
    class of ``k + 1`` tokens, ``P(Binomial(k, p) > k * allowed)``, weighted."""
    if p <= 0.0:
        return 0.0
    p = min(p, 1.0)
    missed = 0.0
    for tokens, weight in classes:
        k = min(int(round(tokens)) - 1, 400)
        if k < 1:
            continue
        j = math.floor(k * allowed) + 1  # this many long gaps or more: a miss
        if j > k:
            continue
        if p >= 1.0:
            missed += weight
            continue
        tail = sum(math.comb(k, i) * p**i * (1.0 - p) ** (k - i) for i in range(j, min(k, j + 60) + 1))
        missed += weight * min(1.0, tail)
    return missed


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """One pool at one interval: how many ready workers it has and their load."""

    pool: str  # POOL_*
    ready: int
    loads: tuple[WorkerLoad, ...] = ()
    # Workers launched but not ready yet, and workers draining (no new work, still running and
    # paid for): both hold GPUs, so a budget check that ignores them overshoots while they last.
    starting: int = 0
    draining: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    now: float  # seconds, the caller's clock (wall or simulated)
    pools: dict[str, PoolObservation]
    traffic: TrafficSample | None = None  # SLA planner only


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """A policy's answer for one pool. ``desired`` is already clamped to the pool's budget."""

    pool: str
    desired: int
    action: str = ACTION_HOLD  # ACTION_*
    reason: str = ""
    detail: str = ""
    inputs: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)


class PlannerPolicy(Protocol):
    """``load`` or ``sla``. Called once per adjustment interval; keeps its own history (grace
    periods, predictor state) between calls."""

    name: str  # "load" | "sla"
    interval_s: float

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        """Desired replicas per pool of the observation. Never raises on odd input (no workers,
        no traffic): it holds and says why."""
        ...
