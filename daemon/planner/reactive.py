"""The reactive core both planners share: what each pool needs now, from live per-worker load and
the frontends' latency, with the reason that drove it.

Every interval (``ReactiveCore.assess``), per pool:

- **capacity**: the demand over a window (one start-up time, at least 6 intervals: one 5 s
  interval of a heavy-tailed trace is noise) -- arrivals x ISL x (1 - prefix hit rate), arrivals x
  OSL, a significant rise carried over the start-up (a ramp is met, not trailed) -- through the
  ``CapacityModel``, times the factor the SLA misses taught (below). A sustained need: it is
  the evidence the scale-down window remembers.
- **backlog**: the prompt tokens still queued when a worker launched now would be ready (the
  queue now, plus what the last interval's arrivals add beyond what the ready workers compute
  during the start-up), cleared within the start-up: queued requests and waiting time count. A
  transient need: the workers it brings go once it is cleared and they served.
- **SLA misses** of a settled fleet (no change under way, the last one ready for an interval):
  the share of requests over the TTFT target and of requests whose mean ITL is over the ITL target,
  from the frontends' histograms (``fraction_over``, ``request_itl_miss``), over the window. A
  TTFT miss adds a prefill (or agg) worker, an ITL miss a decode worker, or in agg an agg worker
  with the reason saying the gaps are prefill chunks sharing steps with decodes.
- **learned factor**: each settled interval moves a per-pool factor on the model's load towards
  the miss rate aimed at (``MISS_AIM`` of the tolerance): up at once to the +1 on a miss, up fast
  over the aim, down slowly (probing one fewer, never below where it last missed) while nothing
  misses. Not from a fleet clearing an old queue, nor from a ramp (the window lags it).
- **KV**: Dynamo's easy-mode KV demand per worker (held + queued blocks / total): any worker over
  the up threshold adds one; the pool may lose one only when every warm worker is under the down
  threshold and the survivors would stay under the up threshold (``max x n / (n - 1)``).

Never fewer than compute the demand flat out. Cold workers (ready for less than one interval) are
left out of the capacity figures measured on workers and of the "every worker is idle" evidence.
NaN and missing figures mean "no demand measured", never "skip the decision".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from dynamod.daemon.planner.capacity import MAX_UTILISATION, CapacityModel, Demand, Sized, ceil_replicas
from dynamod.daemon.planner.policy import (
    Observation,
    PoolObservation,
    TrafficSample,
    WorkerLoad,
    fraction_over,
    request_itl_miss,
)
from dynamod.shared.protocol.planner import POOL_AGG, POOL_DECODE, POOL_PREFILL

# Reasons (``PlannerDecision.reason``), most urgent first: a tie reports the first.
R_TTFT_MISS = "ttft_miss"
R_ITL_MISS = "itl_miss"
R_ITL_INTERFERENCE = "itl_miss_prefill_interference"
R_BACKLOG = "queue_backlog"
R_CAPACITY = "capacity"
R_KV_HIGH = "kv_usage_high"
R_QUEUE_HIGH = "queue_high"
R_PREDICTED = "sla_throughput"
R_IDLE = "no_traffic"
R_COLD = "cold_start"
R_WITHIN = "within_thresholds"
R_CONSOLIDATION = "consolidation_guard"
REASON_ORDER = (R_TTFT_MISS, R_ITL_INTERFERENCE, R_ITL_MISS, R_BACKLOG, R_KV_HIGH, R_QUEUE_HIGH, R_PREDICTED,
                R_CAPACITY, R_CONSOLIDATION, R_COLD, R_WITHIN, R_IDLE)

DEFAULT_MISS_TOLERANCE = 0.03  # share of requests over the TTFT target (1 - a 97% attainment goal)
DEFAULT_ITL_GAP_TOLERANCE = 0.03  # share of requests whose mean ITL is over the target
MIN_MISSES = 3  # fewer misses than this in the window are noise, not a trend
MISS_AIM = 2.0 / 3.0  # the learned factor aims at this share of the tolerance
MIN_SAMPLES = 20
TREND_CAP = 1.5  # a projected rate at most this times the recent one
RAMP = 1.5  # the last interval's rate this much over the window's: demand is rising, do not learn  # requests (TTFT) or gaps (ITL) before a miss rate says anything
LEARN_UP_S = 30.0  # e-folding time of the learned factor's rise while misses exceed the aim
LEARNED_RANGE = (0.25, 4.0)


@dataclass(frozen=True, slots=True)
class Need:
    """What one pool needs this interval, and why."""

    pool: str
    replicas: int
    reason: str
    detail: str
    inputs: dict[str, float] = field(default_factory=dict)
    # A queue to clear is met by a burst of capacity, not kept: it is no evidence for the
    # scale-down window (``ScaleGuard``), unlike a sustained rate or a learned miss.
    transient: bool = False


def warm(loads: tuple[WorkerLoad, ...], interval_s: float) -> list[WorkerLoad]:
    """The load reports of workers past their first interval (unknown age counts as warm)."""
    return [w for w in loads if w.ready_for_s is None or w.ready_for_s >= interval_s]


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(slots=True)
class KvThresholds:
    up: float  # KV demand (0..1+) of any worker that adds one
    down: float  # every warm worker under this may lose one
    inclusive: bool = False  # Dynamo's "load" target compares with >=


class ReactiveCore:
    """See the module docstring. Remembers the last measured ISL/OSL (an interval with arrivals
    but no finished request still has demand) and the last hit rate."""

    def __init__(self, model: CapacityModel, *, mode: str, interval_s: float, kv: KvThresholds | None,
                 kv_block_size: int | None = None, miss_tolerance: float = DEFAULT_MISS_TOLERANCE,
                 itl_gap_tolerance: float = DEFAULT_ITL_GAP_TOLERANCE, startup_s: float = 30.0,
                 demand_window_s: float | None = None, learn_half_life_s: float = 90.0) -> None:
        self.model = model
        self.mode = mode
        self.interval_s = interval_s
        self.startup_s = startup_s
        # Demand and misses are read over a window (one start-up time, at least 6 intervals): one
        # 5 s interval of a heavy-tailed trace is mostly noise.
        self.demand_window_s = demand_window_s if demand_window_s is not None else max(startup_s, 6 * interval_s)
        self._recent: deque[tuple[float, TrafficSample]] = deque()
        self.short_rate = 0.0  # the last interval's arrivals per second
        self._first_at: float | None = None  # when the first sample began
        self.observed_s = 0.0  # seconds of traffic measured so far
        self.trend_rate = 0.0  # the window's rate carried to when a new worker would be ready
        # What the SLA misses taught, per pool: the factor on the model's load that meets the
        # targets on this engine and this traffic (the model's agg prefill share is a bound, the
        # truth depends on how many requests are short). Each settled interval moves it towards
        # the miss rate aimed at (``MISS_AIM`` of the tolerance): up fast when misses pass the tolerance
        # (the fleet pays for each miss), down slowly while nothing misses (half-life
        # ``learn_half_life_s``). Misses behind a queue do not count: the backlog sizing answers those.
        self.learned: dict[str, float] = {}
        self.learn_half_life_s = learn_half_life_s
        self._settled_since: dict[str, float | None] = {}
        self._k_floor: dict[str, float] = {}
        self._last_committed: dict[str, int] = {}  # per pool: the learned factor at the last miss
        self.kv = kv
        self.kv_block_size = kv_block_size
        self.miss_tolerance = miss_tolerance
        self.itl_gap_tolerance = itl_gap_tolerance
        self.isl: float | None = None
        self.osl: float | None = None
        self.hit_rate = 0.0
        self.ttft_ms: float | None = None
        self.itl_ms: float | None = None

    # ---- demand --------------------------------------------------------------------------------

    def demand(self, obs: Observation) -> Demand:
        """The demand over the window and the prompt tokens queued now (``backlog_tokens``)."""
        t = obs.traffic
        if t is not None and t.duration_s > 0:
            self._recent.append((obs.now, t))
            self.short_rate = finite(t.num_requests / t.duration_s) or 0.0
        while self._recent and self._recent[0][0] <= obs.now - self.demand_window_s:
            self._recent.popleft()
        samples = [s for _, s in self._recent]
        if self._first_at is None and samples:
            self._first_at = obs.now - samples[0].duration_s
        self.observed_s = 0.0 if self._first_at is None else obs.now - self._first_at
        seconds = sum(s.duration_s for s in samples)
        arrivals = sum(finite(s.num_requests) or 0.0 for s in samples)
        rate = arrivals / seconds if seconds > 0 else 0.0
        # A rising rate: what it will be when a worker launched now is ready (the trend between
        # the window's halves, carried over the start-up), so a ramp is met, not trailed.
        self.trend_rate = rate
        if len(samples) >= 4 and self.observed_s >= self.demand_window_s:
            half = len(samples) // 2
            old_s, new_s = samples[:half], samples[half:]
            r_old = sum(finite(x.num_requests) or 0.0 for x in old_s) / max(sum(x.duration_s for x in old_s), 1e-9)
            r_new = sum(finite(x.num_requests) or 0.0 for x in new_s) / max(sum(x.duration_s for x in new_s), 1e-9)
            t_old = max(sum(x.duration_s for x in old_s), 1e-9)
            t_new = max(sum(x.duration_s for x in new_s), 1e-9)
            slope = (r_new - r_old) / max(seconds / 2.0, 1e-9)
            # Poisson arrivals wobble: only a rise beyond two standard errors is a trend. Carried
            # from the recent half over the start-up, at most half again (a step is not a ramp).
            noise = 2.0 * math.sqrt(r_new / t_new + r_old / t_old)
            if r_new - r_old > noise:
                self.trend_rate = max(rate, min(r_new + slope * self.startup_s, TREND_CAP * r_new))
        rate = self.trend_rate
        self.isl = _weighted(samples, "isl") or self.isl
        # The measured means over the window, for the decision record (what the SLA was judged on
        # is the histograms' tails, in ``ttft_over_frac`` / ``itl_over_frac``).
        self.ttft_ms = _weighted(samples, "ttft_ms")
        self.itl_ms = _weighted(samples, "itl_ms")
        self.osl = _weighted(samples, "osl") or self.osl
        prefill_pool = POOL_AGG if self.mode == "agg" else POOL_PREFILL
        pobs = obs.pools.get(prefill_pool) or PoolObservation(prefill_pool, 0)
        measured = _weighted(samples, "hit_rate", allow_zero=True)
        if measured is not None:
            self.hit_rate = measured
        else:
            hot = warm(pobs.loads, self.interval_s)
            if hot:
                self.hit_rate = sum(w.prefix_hit_rate for w in hot) / len(hot)
        backlog = float(sum(w.active_prefill_tokens for w in pobs.loads))
        return Demand(rate, self.isl or 0.0, self.osl or 0.0, self.hit_rate, backlog * (1.0 - min(self.hit_rate, 0.95)))

    def projected_backlog(self, demand: Demand, ready: int, thpt: float) -> float:
        """Prompt tokens still queued when a worker launched now is ready: today's queue plus
        what the last interval's rate adds beyond what the ready workers compute meanwhile."""
        inflow = self.short_rate * demand.isl * (1.0 - min(demand.hit_rate, 0.95))
        return max(0.0, demand.backlog_tokens + (inflow - ready * thpt) * self.startup_s)

    def missed(self, since: float = -math.inf) -> tuple[float | None, float | None, float, float, float, float]:
        """(share of requests over TTFT, share of gaps over ITL, how many of each, how many
        requests and gaps in all) in the window, counting only intervals that ended after ``since``."""
        recent = [s for t, s in self._recent if t > since]
        ttft = _merge_buckets([s.ttft_buckets for s in recent])
        itl = _merge_buckets([s.itl_buckets for s in recent])
        osl = _merge_buckets([s.osl_buckets for s in recent])
        t_over = fraction_over(ttft, self.model.ttft_ms)
        # ITL is judged per request (its mean), as the SLA is, from what a frontend exposes: long
        # gaps spread at random spoil short requests (``request_itl_miss``, from the gap and
        # output histograms), long gaps in a busy stretch spoil every request in it (the gap
        # share). Either may dominate; the larger is the estimate.
        gap_share = fraction_over(itl, self.model.itl_ms)
        spread = request_itl_miss(itl, osl, self.model.itl_ms) if osl else None
        i_over = gap_share if spread is None else max(spread, gap_share or 0.0)
        t_total = ttft[-1][1] if ttft else 0.0
        i_total = (osl[-1][1] if osl else itl[-1][1]) if itl else 0.0
        return t_over, i_over, (t_over or 0.0) * t_total, (i_over or 0.0) * i_total, t_total, i_total

    # ---- per pool ------------------------------------------------------------------------------

    def assess(self, obs: Observation, committed: dict[str, int], *, d_correction: float = 1.0) -> tuple[dict[str, list[Need]], Demand, Sized]:
        """Every need of every pool this interval (the caller takes the largest), the demand and
        the capacity model's sizing of it."""
        demand = self.demand(obs)
        pools = (POOL_AGG,) if self.mode == "agg" else (POOL_PREFILL, POOL_DECODE)
        ready = {p: (obs.pools.get(p) or PoolObservation(p, 0)).ready for p in pools}
        ttft_pool = POOL_AGG if self.mode == "agg" else POOL_PREFILL
        thpt = self.model.prefill_thpt(max(demand.isl, 1.0))
        projected = self.projected_backlog(demand, ready[ttft_pool], thpt)
        sized = self.model.size(Demand(demand.request_rate, demand.isl, demand.osl, demand.hit_rate, projected),
                                d_correction=d_correction, ready=max(1, ready[ttft_pool]), clear_s=self.startup_s)
        base = {"request_rate": round(demand.request_rate, 4), "isl": round(demand.isl, 1), "osl": round(demand.osl, 1),
                "hit_rate": round(demand.hit_rate, 3), "backlog_tokens": round(demand.backlog_tokens, 1),
                "projected_backlog_tokens": round(projected, 1), "last_interval_rate": round(self.short_rate, 4),
                **sized.as_inputs()}
        for name, value in (("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms)):
            if value is not None:
                base[name] = round(value, 3)
        out: dict[str, list[Need]] = {}
        for pool in pools:
            pobs = obs.pools.get(pool) or PoolObservation(pool, 0)
            have = committed.get(pool, pobs.ready)
            if pobs.starting or have != pobs.ready or have != self._last_committed.get(pool, have):
                self._settled_since[pool] = None  # a change under way: the old fleet's misses are not its
            self._last_committed[pool] = have
            if self._settled_since.get(pool, -math.inf) is None and not pobs.starting and have == pobs.ready:
                self._settled_since[pool] = obs.now
            inputs = dict(base, ready=float(pobs.ready), starting=float(pobs.starting),
                          draining=float(pobs.draining), **_load_inputs(pobs.loads))
            if pobs.loads:
                inputs["cold_workers"] = float(len(pobs.loads) - len(warm(pobs.loads, self.interval_s)))
            out[pool] = self._needs(pool, pobs, obs, demand, sized, have, inputs)
        return out, demand, sized

    def _needs(self, pool: str, pobs: PoolObservation, obs: Observation, demand: Demand, sized: Sized,
               committed: int, inputs: dict[str, float]) -> list[Need]:
        needs: list[Need] = []
        is_prefill = pool == POOL_PREFILL
        load = sized.decode_load if pool == POOL_DECODE else sized.prefill_load
        k = self.learned.get(pool, 1.0)
        # Whatever was learned, never fewer than compute the demand flat out (at MAX_UTILISATION).
        busy = demand.prefill_tokens_s / sized.prefill_thpt + (sized.decode_load if pool == POOL_AGG else 0.0)
        physical = ceil_replicas(busy / MAX_UTILISATION) if pool != POOL_DECODE else 0
        steady = max(ceil_replicas(load * k), physical)
        inputs["learned_factor"] = round(k, 3)
        if demand.request_rate <= 0 and demand.backlog_tokens <= 0 and not any(w.num_running for w in pobs.loads):
            needs.append(Need(pool, 0, R_IDLE, "no request arrived, none queued or running", inputs))
        else:
            learned = f" x learned {k:.2f} (from the SLA misses measured)" if abs(k - 1.0) > 1e-9 else ""
            if is_prefill:
                detail = (f"{demand.request_rate:.3g} req/s x {demand.isl:.0f} tok x (1 - hit {demand.hit_rate:.2f}) / "
                          f"{sized.prefill_thpt:.0f} tok/s at utilisation {sized.prefill_cap:.2f}{learned} -> {steady}")
            elif pool == POOL_DECODE:
                detail = (f"{demand.request_rate:.3g} req/s x {demand.osl:.0f} tok / {sized.decode_thpt:.0f} tok/s "
                          f"within ITL {self.model.itl_ms:g} ms{learned} -> {steady}")
            else:
                detail = (f"prefill {demand.request_rate:.3g} req/s x {demand.isl:.0f} tok x (1 - hit {demand.hit_rate:.2f}) "
                          f"/ {sized.prefill_thpt:.0f} tok/s at most {sized.prefill_cap:.2f} of each worker's time (ITL "
                          f"{self.model.itl_ms:g} ms with prefill chunks in the steps), decode {demand.osl:.0f} tok / "
                          f"{sized.decode_thpt:.0f} tok/s{learned} -> {steady}")
            # Until a whole window was measured the rate is a guess: it may size up, it is no evidence.
            young = self.observed_s < self.demand_window_s
            needs.append(Need(pool, steady, R_CAPACITY, f"over the last {min(self.observed_s, self.demand_window_s):g} s: "
                              f"{detail}", inputs, transient=young))
            projected = inputs["projected_backlog_tokens"]
            clear_s = max(self.model.ttft_ms / 1000.0, self.startup_s, 1e-3)
            n_cap = ceil_replicas(load * k + projected / (sized.prefill_thpt * clear_s)) if pool != POOL_DECODE else 0
            if projected > 0 and n_cap > steady:
                needs.append(Need(pool, n_cap, R_BACKLOG,
                                  f"{inputs['projected_backlog_tokens']:.0f} prompt tokens queued when a worker launched "
                                  f"now is ready (queue {demand.backlog_tokens:.0f} + last interval "
                                  f"{self.short_rate:.3g} req/s beyond what {pobs.ready} ready compute, for the "
                                  f"{self.startup_s:g} s start-up), cleared within it -> {n_cap}", inputs, transient=True))
        needs.extend(self._misses(pool, pobs, obs, sized, load, committed, inputs))
        kv = self._kv_need(pool, pobs, inputs)
        if kv is not None:
            needs.append(kv)
        return needs

    def _misses(self, pool: str, pobs: PoolObservation, obs: Observation, sized: Sized, load: float,
                committed: int, inputs: dict[str, float]) -> list[Need]:
        """SLA misses of a settled fleet (no worker starting, the last change ready for an
        interval: misses before that are the old fleet's, which the change is curing)."""
        if obs.traffic is None or pobs.ready <= 0:
            return []
        settled = self._settled_since.get(pool, -math.inf)
        if settled is None:
            return []
        # Judge a fleet on the intervals after it settled. Requests that waited in a queue from
        # before get their first token after it: a fleet clearing an old queue in its first
        # window is not learnt from (an undersized one that queues later is).
        queued = pool != POOL_DECODE and sized.backlog_s * 1000.0 > self.model.ttft_ms
        fresh = obs.now - settled < self.demand_window_s
        since = settled + self.interval_s
        ttft_over, itl_over, ttft_n, itl_n, ttft_total, itl_total = self.missed(since=since)
        if ttft_over is not None:
            inputs["ttft_over_frac"] = round(ttft_over, 4)
        if itl_over is not None:
            inputs["itl_over_frac"] = round(itl_over, 4)
        window = f"over the last {min(self.demand_window_s, obs.now - settled):g} s"
        step = committed + 1
        ttft_missed = ttft_over is not None and ttft_over > self.miss_tolerance and ttft_n >= MIN_MISSES
        itl_missed = itl_over is not None and itl_over > self.itl_gap_tolerance and itl_n >= MIN_MISSES
        out: list[Need] = []
        if ttft_missed and pool in (POOL_AGG, POOL_PREFILL):
            out.append(Need(pool, step, R_TTFT_MISS,
                            f"TTFT over {self.model.ttft_ms:g} ms for {ttft_over:.1%} of requests {window}: "
                            f"{committed} -> {step}", inputs))
        if itl_missed and pool in (POOL_AGG, POOL_DECODE):
            what = f"an estimated {itl_over:.1%} of requests (mean ITL, from the gap and output histograms) {window}"
            if pool == POOL_AGG:
                out.append(Need(pool, step, R_ITL_INTERFERENCE,
                                f"ITL over {self.model.itl_ms:g} ms for {what}: prefill chunks share steps with decodes "
                                f"(planned prefill share {sized.prefill_cap:.2f}); more workers prefill less each "
                                f"(or move to a disaggregated split): {committed} -> {step}", inputs))
            else:
                out.append(Need(pool, step, R_ITL_MISS, f"ITL over {self.model.itl_ms:g} ms for {what}: "
                                f"{committed} -> {step}", inputs))
        ratios = []
        if pool != POOL_DECODE and ttft_over is not None and ttft_total >= MIN_SAMPLES:
            ratios.append(ttft_over / (self.miss_tolerance * MISS_AIM))
        if pool != POOL_PREFILL and itl_over is not None and itl_total >= MIN_SAMPLES:
            ratios.append(itl_over / (self.itl_gap_tolerance * MISS_AIM))
        # Nor from a ramp: the window's rate lags a rising demand, and the misses are the lag's.
        rate = inputs.get("request_rate", 0.0)
        ramping = self.short_rate > RAMP * rate
        if ratios and load > 0 and not (queued and fresh) and not ramping:
            k = self.learned.get(pool, 1.0)
            ratio = max(ratios)
            if out:
                k = max(k, step / load)  # the model now asks at least the +1
                # and never probes below where it just missed (that floor fades 10x slower,
                # so a changed traffic mix is probed again, but a constant one does not flap)
                self._k_floor[pool] = max(self._k_floor.get(pool, 0.0), step / load)
            elif ratio > 1.0:
                k *= math.exp(self.interval_s / LEARN_UP_S * min(ratio - 1.0, 2.0))
            elif committed <= ceil_replicas(load * k):
                # No miss at the size the model asks: probe one fewer, slowly. (A fleet held larger
                # by something else says nothing about a smaller one.)
                decay = 0.5 ** (self.interval_s / max(self.learn_half_life_s, 1e-9) * (1.0 - ratio))
                k = max((committed - 1) / load, self._k_floor.get(pool, 0.0), k * decay)
            self.learned[pool] = min(max(k, LEARNED_RANGE[0]), LEARNED_RANGE[1])
        if pool in self._k_floor:
            self._k_floor[pool] *= 0.5 ** (self.interval_s / max(10 * self.learn_half_life_s, 1e-9))
        return out

    def _kv_need(self, pool: str, pobs: PoolObservation, inputs: dict[str, float]) -> Need | None:
        if self.kv is None or pool == POOL_PREFILL:
            return None
        loads = [w for w in pobs.loads if w.total_blocks > 0]
        if not loads:
            return None
        values = [self.kv_demand(w, pool == POOL_AGG) for w in loads]
        inputs["kv_demand_max"] = round(max(values), 4)
        up = self.kv.up
        over = [v >= up if self.kv.inclusive else v > up for v in values]
        if any(over):
            return Need(pool, pobs.ready + 1, R_KV_HIGH,
                        f"{sum(over)} of {len(values)} workers over KV demand {up:g} (max {max(values):.3f})", inputs)
        hot = [self.kv_demand(w, pool == POOL_AGG) for w in warm(tuple(loads), self.interval_s)]
        n = pobs.ready
        under = [v <= self.kv.down if self.kv.inclusive else v < self.kv.down for v in values]
        if len(hot) < len(values):
            return Need(pool, n, R_COLD, f"{len(values) - len(hot)} of {len(values)} workers in their first interval: "
                        "their load is no evidence the pool may shrink", inputs, transient=True)
        if not all(under):
            return Need(pool, n, R_WITHIN, f"KV demand max {max(values):.3f} between down {self.kv.down:g} and up {up:g}",
                        inputs)
        if n > 1 and max(values) * n / (n - 1) >= up:
            return Need(pool, n, R_CONSOLIDATION,
                        f"every worker under {self.kv.down:g}, but the {n - 1} left would carry "
                        f"{max(values) * n / (n - 1):.3f} >= {up:g}", inputs)
        return None  # KV says nothing against shrinking

    def kv_demand(self, w: WorkerLoad, agg: bool) -> float:
        """``(held + queued blocks) / total``: waiting requests at the running ones' mean size, and
        in agg the queued prompt tokens in blocks (Dynamo's ``(scheduled + queued [+ prefill]) / max``)."""
        held = max(float(w.active_decode_blocks), w.kv_usage * w.total_blocks)
        per_request = held / w.num_running if w.num_running else 0.0
        queued = w.num_waiting * per_request
        if agg and self.kv_block_size:
            queued += w.active_prefill_tokens / self.kv_block_size
        return (held + queued) / w.total_blocks


def _load_inputs(loads: tuple[WorkerLoad, ...]) -> dict[str, float]:
    if not loads:
        return {}
    n = len(loads)
    return {
        "kv_usage": round(sum(w.kv_usage for w in loads) / n, 4),
        "kv_usage_max": round(max(w.kv_usage for w in loads), 4),
        "num_waiting": float(sum(w.num_waiting for w in loads)),
        "num_running": float(sum(w.num_running for w in loads)),
        "prefill_queue_tokens": float(sum(w.active_prefill_tokens for w in loads)),
    }


def strongest(needs: list[Need]) -> Need:
    """The largest need; on a tie the most urgent reason (``REASON_ORDER``)."""
    def rank(n: Need) -> tuple[int, int]:
        order = REASON_ORDER.index(n.reason) if n.reason in REASON_ORDER else len(REASON_ORDER)
        return (n.replicas, -order)
    return max(needs, key=rank)


def _weighted(samples: list[TrafficSample], attr: str, *, allow_zero: bool = False) -> float | None:
    """The mean of ``attr`` over samples, weighted by their arrivals; NaN and missing are skipped."""
    num = den = 0.0
    for s in samples:
        v = finite(getattr(s, attr))
        if v is None or (v <= 0 and not allow_zero):
            continue
        weight = max(finite(s.num_requests) or 0.0, 1e-6)
        num += v * weight
        den += weight
    return num / den if den > 0 else None


def _merge_buckets(hists: list[tuple[tuple[float, float], ...]]) -> tuple[tuple[float, float], ...]:
    """Cumulative histograms with the same bounds, added up (bounds that differ are kept apart)."""
    total: dict[float, float] = {}
    for h in hists:
        for bound, count in h:
            total[bound] = total.get(bound, 0.0) + count
    return tuple(sorted(total.items()))

