"""The planner in the replay loop: the daemon's policies, fed from simulated cores, on the simulated clock.

Every ``interval_s`` of simulated time the loop builds the same ``Observation`` the planner daemon
builds from the event plane and the frontends' metrics (ready workers and their load reports; the
requests that finished in the interval as the traffic sample), asks the policy, and carries the
answer out as a connector would: a scale-up launches a core that takes no work until
``startup_s`` has passed (it is paid for from launch), a scale-down first cancels cores still
starting, then drains the least-loaded ready cores (no new requests; they stop when their
in-flight work is done, so no request is lost). Every GPU held (starting, ready or draining
workers) counts against ``--max-gpu-budget``: a launch that would pass it waits for a drain to end,
so a P/D rebalance never exceeds the budget, even for a moment.

The observation carries what the live planner reads: per worker its load report, how long it has
been ready and its prefix hit rate; per pool the workers starting and draining; and the traffic
sample with the frontends' TTFT (requests whose first token came in the interval) and ITL (the
token gaps of requests that finished in it) histograms, on the frontend's own buckets.

``compare_static`` replays the same requests on every static allocation the budget allows, to say
what the planner bought: see ``StaticComparison``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dynamod.daemon.planner.budget import ReplicaBudget
from dynamod.daemon.planner.policy import (
    Observation,
    PlannerPolicy,
    PoolObservation,
    TrafficSample,
    WorkerLoad,
)
from dynamod.daemon.replay.fleet import DRAINING, READY, STARTING, STOPPED, SimulatedFleet, SimulatedPool
from dynamod.daemon.replay.report import RequestStats
from dynamod.shared.observability.metrics import ITL_BUCKETS_S, LATENCY_BUCKETS, TOKEN_BUCKETS
from dynamod.shared.protocol.planner import ACTION_HOLD, POOL_AGG, POOL_DECODE, POOL_PREFILL

DEFAULT_STARTUP_S = 30.0  # a worker's launch to ready: engine start, weights loaded, registered
TTFT_BOUNDS_MS = tuple(b * 1000.0 for b in LATENCY_BUCKETS)  # the frontend's histogram buckets
ITL_BOUNDS_MS = tuple(b * 1000.0 for b in ITL_BUCKETS_S)
OSL_BOUNDS = tuple(float(b) for b in TOKEN_BUCKETS)


@dataclass(slots=True)
class ReplayPlanner:
    policy: PlannerPolicy
    startup_s: float = DEFAULT_STARTUP_S
    timeline: list[dict[str, Any]] = field(default_factory=list)
    decisions: int = 0
    scale_ups: int = 0
    scale_downs: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    _window: list[RequestStats] = field(default_factory=list)
    _open_before: int = 0  # requests in flight at the previous tick
    _seen: int = 0  # requests (in arrival order) already watched for their first token
    _awaiting: list[RequestStats] = field(default_factory=list)  # arrived, no first token yet
    _streaming: list[RequestStats] = field(default_factory=list)  # first token seen, not finished at the last tick
    _last_tick_ms: float = 0.0
    max_gpus_held: int = 0  # the most GPUs held at once (starting + ready + draining)

    @property
    def interval_ms(self) -> float:
        return self.policy.interval_s * 1000.0

    def on_finish(self, st: RequestStats) -> None:
        self._window.append(st)

    @staticmethod
    def pools(sim: SimulatedFleet) -> dict[str, SimulatedPool]:
        if sim.policy is None:
            return {POOL_AGG: sim.decode}
        return {POOL_PREFILL: sim.prefill, POOL_DECODE: sim.decode}

    def tick(self, sim: SimulatedFleet) -> None:

        observation = self.observe(sim)
        plans = self.policy.plan(observation)
        self.decisions += 1
        pools = self.pools(sim)
        budget = _budget_of(self.policy)
        # Shrink first: a rebalance frees GPUs (once the drains end) before the other pool grows.
        def grows(name: str) -> bool:
            pool = pools.get(name)
            return pool is None or plans[name].desired >= len(pool.ids(STARTING)) + len(pool.ids(READY))

        for name, plan in sorted(plans.items(), key=lambda kv: grows(kv[0])):
            pool = pools.get(name)
            if pool is None:
                continue
            self.reasons[plan.reason] = self.reasons.get(plan.reason, 0) + 1
            starting, ready = pool.ids(STARTING), pool.ids(READY)
            have = len(starting) + len(ready)
            if plan.desired > have:
                launch = plan.desired - have
                if budget is not None and budget.max_gpu_budget > 0:
                    per = budget.gpus_for(name)
                    launch = min(launch, max(0, budget.max_gpu_budget - gpus_held(pools, budget)) // per)
                if launch:
                    self.scale_ups += 1
                for _ in range(launch):
                    sim.launch_core(pool, self.startup_s * 1000.0)
            elif plan.desired < have:
                self.scale_downs += 1
                excess = have - plan.desired
                for w in reversed(starting[-excess:]):  # newest first: the cheapest to give up
                    sim.drain_core(pool, w)
                excess -= min(excess, len(starting))
                for w in sorted(ready, key=lambda i: (pool.cores[i].num_requests, -i))[:excess]:
                    sim.drain_core(pool, w)
            if plan.action != ACTION_HOLD or plan.desired != have:
                self.timeline.append({
                    "t_s": round(sim.now / 1000.0, 1), "pool": name, "ready": len(ready), "desired": plan.desired,
                    "action": plan.action, "reason": plan.reason,
                })
        if budget is not None:
            self.max_gpus_held = max(self.max_gpus_held, gpus_held(pools, budget))

    def observe(self, sim: SimulatedFleet) -> Observation:

        now_ms = sim.now
        startup_ms = self.startup_s * 1000.0
        pools: dict[str, PoolObservation] = {}
        for name, pool in self.pools(sim).items():
            loads = []
            for w in pool.ids(READY):
                load = pool.cores[w].load()
                # cores of the starting fleet are ready from 0; launched ones startup_s after launch
                ready_at = pool.launched_ms[w] + (startup_ms if pool.launched_ms[w] > 0 else 0.0)
                loads.append(WorkerLoad(
                    worker_id=w, kv_usage=load.kv_usage, num_waiting=load.num_waiting, num_running=load.num_running,
                    # as a live worker reports it: the batch being computed is still queued
                    active_prefill_tokens=load.active_prefill_tokens + pool.inflight_prefill[w],
                    active_decode_blocks=load.active_blocks, total_blocks=load.total_blocks,
                    ready_for_s=max(0.0, (now_ms - ready_at) / 1000.0), prefix_hit_rate=load.prefix_hit_rate,
                ))
            pools[name] = PoolObservation(pool=name, ready=len(loads), loads=tuple(loads),
                                          starting=len(pool.ids(STARTING)), draining=len(pool.ids(DRAINING)))
        window, self._window = self._window, []
        # Arrivals, as the live planner counts them: finished plus the growth of in-flight.
        open_now = sim.open_requests
        arrivals = len(window) + open_now - self._open_before
        self._open_before = open_now
        firsts = self._first_tokens(sim)
        traffic = traffic_sample(window, self.policy.interval_s, arrivals=arrivals, first_tokens=firsts,
                                 inflight=open_now, gaps=self._gaps(firsts, sim.now))
        return Observation(now=sim.now / 1000.0, pools=pools, traffic=traffic)

    def _gaps(self, firsts: list[RequestStats], now_ms: float) -> list[float]:
        """Token gaps that ended in this interval, of every streaming request: the frontend
        observes each gap as the token goes out, not when the request ends."""
        since = self._last_tick_ms
        self._last_tick_ms = now_ms
        self._streaming.extend(firsts)
        out: list[float] = []
        still = []
        for st in self._streaming:
            times = st.token_times
            i = max(1, bisect.bisect_right(times, since))
            out.extend(times[j] - times[j - 1] for j in range(i, len(times)))
            if st.finish_ms < 0:
                still.append(st)
        self._streaming = still
        return out

    def _first_tokens(self, sim: SimulatedFleet) -> list[RequestStats]:
        """Requests whose first token came since the last tick (the frontend observes TTFT then)."""
        stats = sim.stats
        if len(stats) > self._seen:
            self._awaiting.extend(itertools.islice(stats.values(), self._seen, None))
            self._seen = len(stats)
        got = [s for s in self._awaiting if s.token_times]
        if got:
            self._awaiting = [s for s in self._awaiting if not s.token_times]
        return got

    def report(self, sim: SimulatedFleet, done: list[RequestStats], end_ms: float) -> dict[str, Any]:
        pools = self.pools(sim)
        return {
            "policy": self.policy.name,
            "interval_s": self.policy.interval_s,
            "startup_s": self.startup_s,
            "decisions": self.decisions,
            "scale_ups": self.scale_ups,
            "scale_downs": self.scale_downs,
            "reasons": dict(sorted(self.reasons.items())),
            "launched": {name: len(pool.cores) for name, pool in pools.items()},
            "peak_workers": {name: peak_workers(pool, end_ms) for name, pool in pools.items()},
            "worker_seconds": {name: round(pool.worker_seconds(end_ms), 3) for name, pool in pools.items()},
            "max_gpus_held": self.max_gpus_held,
            "timeline": self.timeline,
        }


def _budget_of(policy: PlannerPolicy) -> ReplicaBudget | None:
    budget = getattr(getattr(policy, "config", None), "budget", None)
    return budget if isinstance(budget, ReplicaBudget) else None


def gpus_held(pools: dict[str, SimulatedPool], budget: ReplicaBudget) -> int:
    """GPUs held now: every core launched and not stopped (starting, ready or draining)."""

    return sum(sum(1 for st in pool.state if st != STOPPED) * budget.gpus_for(name) for name, pool in pools.items())


def _histogram(values: Iterable[float], bounds: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """Cumulative ``(upper bound, count)`` pairs, as a Prometheus histogram exposes them."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    out, total = [], 0
    for bound, c in zip((*bounds, float("inf")), counts, strict=True):
        total += c
        out.append((bound, float(total)))
    return tuple(out) if total else ()


def traffic_sample(window: list[RequestStats], duration_s: float, arrivals: int | None = None,
                   first_tokens: list[RequestStats] | None = None, inflight: int | None = None,
                   gaps: list[float] | None = None) -> TrafficSample:
    """What a frontend's metrics say about one interval: the requests that arrived (``arrivals``;
    by default the ones that finished), the finished ones' mean ISL, OSL and ITL (token-weighted,
    as a Prometheus histogram's mean), the histogram of the token gaps that ended in the interval
    (``gaps``; by default the finished requests' gaps), and the TTFT and ISL of the requests whose
    first token came in it (``first_tokens``; by default the finished ones), as the frontend
    observes them."""
    count = float(len(window) if arrivals is None else max(0, arrivals))
    firsts = window if first_tokens is None else first_tokens
    ttfts = [s.token_times[0] - s.arrival_ms for s in firsts if s.token_times]
    if gaps is None:
        gaps = [b - a for s in window for a, b in itertools.pairwise(s.token_times)]
    n = len(window)
    gap_total = sum(s.token_times[-1] - s.token_times[0] for s in window if len(s.token_times) > 1)
    gap_count = sum(len(s.token_times) - 1 for s in window if len(s.token_times) > 1)
    prompt = sum(s.prompt_tokens for s in window)
    isl_from = [s for s in firsts if s.token_times]
    return TrafficSample(
        duration_s=duration_s,
        num_requests=count,
        isl=sum(s.prompt_tokens for s in isl_from) / len(isl_from) if isl_from else None,
        osl=sum(max(1, s.output_tokens) for s in window) / n if n else None,
        ttft_ms=sum(ttfts) / len(ttfts) if ttfts else None,
        itl_ms=gap_total / gap_count if gap_count else None,
        ttft_buckets=_histogram(ttfts, TTFT_BOUNDS_MS),
        itl_buckets=_histogram(gaps, ITL_BOUNDS_MS),
        osl_buckets=_histogram((max(1, s.output_tokens) for s in window), OSL_BOUNDS),
        inflight=None if inflight is None else float(inflight),
        hit_rate=sum(s.cached_tokens for s in window) / prompt if prompt else None,
    )


def peak_workers(pool: SimulatedPool, end_ms: float) -> int:
    """Most cores alive (launched, not stopped) at once."""
    edges = sorted([(t, 1) for t in pool.launched_ms] +
                   [(t if t >= 0 else end_ms, -1) for t in pool.stopped_ms], key=lambda e: (e[0], e[1]))
    alive = peak = 0
    for _, step in edges:
        alive += step
        peak = max(peak, alive)
    return peak


# ---- the static baseline ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StaticRun:
    allocation: dict[str, int]
    attainment_pct: float
    worker_seconds: float


@dataclass(slots=True)
class StaticComparison:
    """Every static allocation the budget allows, replayed on the same requests.

    - ``best``: the highest SLA attainment (ties: fewer worker-seconds): what a fixed fleet of
      the same budget achieves at best;
    - ``cheapest_matching``: the fewest worker-seconds whose attainment is at least the planner's
      (None when no static allocation reaches it): what the planner saves at equal quality.
    """

    runs: list[StaticRun]
    best: StaticRun | None
    cheapest_matching: StaticRun | None

    def to_json(self) -> dict[str, Any]:
        def one(r: StaticRun | None) -> dict[str, Any] | None:
            return None if r is None else {"allocation": r.allocation, "attainment_pct": r.attainment_pct,
                                           "worker_seconds": r.worker_seconds}
        return {"best": one(self.best), "cheapest_matching": one(self.cheapest_matching),
                "runs": [one(r) for r in self.runs]}


def static_allocations(budget: ReplicaBudget, disagg: bool) -> list[dict[str, int]]:
    """The allocations a fixed fleet could have under ``budget`` (GPU budget and per-pool max)."""
    if not disagg:
        return [{POOL_AGG: n} for n in range(max(1, budget.decode_min), budget.max_for(POOL_AGG) + 1)]
    out = []
    for p, d in itertools.product(range(max(1, budget.prefill_min), budget.max_for(POOL_PREFILL) + 1),
                                  range(max(1, budget.decode_min), budget.max_for(POOL_DECODE) + 1)):
        alloc = {POOL_PREFILL: p, POOL_DECODE: d}
        if budget.max_gpu_budget <= 0 or budget.gpus(alloc) <= budget.max_gpu_budget:
            out.append(alloc)
    return out


def compare_static(allocations: Iterable[dict[str, int]], run: Callable[[dict[str, int]], dict[str, Any]],
                   planner_attainment: float) -> StaticComparison:
    """Runs ``run(allocation)`` (a replay returning its summary, with ``sla`` and
    ``worker_seconds``) for each allocation and picks ``best`` and ``cheapest_matching``."""
    runs = []
    for alloc in allocations:
        res = run(alloc)
        runs.append(StaticRun(alloc, float(res["sla"]["attainment_pct"]), float(res["worker_seconds"])))
    best = max(runs, key=lambda r: (r.attainment_pct, -r.worker_seconds), default=None)
    matching = [r for r in runs if r.attainment_pct >= planner_attainment]
    cheapest = min(matching, key=lambda r: (r.worker_seconds, -r.attainment_pct), default=None)
    return StaticComparison(runs, best, cheapest)

