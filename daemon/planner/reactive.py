"""The reactive core both planners share: what each pool needs now, from live per-worker load and
the frontends' latency, with the reason that drove it.

Every interval (``ReactiveCore.assess``), per pool:

- **capacity**: the demand over a window (one start-up time, at least 6 intervals: one 5 s
  interval of a heavy-tailed trace is noise) -- arrivals x ISL x (1 - prefix hit rate), arrivals x
  OSL, a significant rise carried over the start-up (a ramp is met, not trailed; in agg also the
  rise of the last start-up time, grown by its ratio (at most ``TREND_CAP``) and carried over
  the next: prefill beyond the plan lands in the decodes' steps at once, while a prefill pool's
  queue absorbs it within TTFT) -- through the ``CapacityModel``, times the factor the SLA
  misses taught (below). A sustained need: it is the evidence the scale-down window remembers.
  In agg, above it, the rate ``forecast.RateForecast`` expects when the workers launched now and
  at the next decision are ready (the arrivals' growth over the last window and start-up): a
  transient need. It scales up ahead of a ramp out of a trough, which the rise trails by a
  start-up; remembered, its fleets were held for a whole release window.
  **A burst's onset** (the forecast sees a step, growth steeper than ``STEP_GROWTH`` over its
  horizon): for one forecast span agg sizes for the rate measured since the onset (the higher
  of the last two intervals' and the recent half window's) instead of the rise carried over a
  start-up, which projects a step at up to 2.5x its level (window + 1.5 x the rise) and
  launched workers for bursts one worker carries (bursty seed 2). The carried rate is still
  remembered (a hold-only need): a fleet the burst's measured level grew is held as before, the
  hedge for the next burst (seeds 3 and 4 meet an intense burst after a mild one with it).
- **backlog**: the prompt tokens still queued when a worker launched now would be ready (the
  queue now, plus what the last interval's arrivals add beyond what the ready workers compute
  during the start-up), cleared within the start-up: queued requests and waiting time count. A
  transient need: the workers it brings go once it is cleared and they served.
- **SLA misses, as an error budget** (``--sla-attainment``, default 98 %: the budget is the 2 %
  of requests that may miss): the share of requests over the TTFT target and of requests whose
  mean ITL is over the ITL target, from the frontends' histograms (``fraction_over``,
  ``request_itl_miss``), judged by burn rate over two windows as an SRE error budget is: the
  fast window (the demand window, intervals after the fleet settled) and the slow one (the
  scale-down window, every interval), multiwindow and multi-burn-rate: a miss adds workers when
  both windows burn over the budget (a low threshold on the slow window), or when the fast
  window alone burns at ``fast_burn_factor`` x the budget (slow window / (fast window +
  start-up): kept up until a worker launched now is ready, such a burn spends the slow window's
  whole budget; the slow window lags a ramp or a burst by minutes). A TTFT miss adds prefill (or
  agg) workers, an ITL miss decode workers, or in agg agg workers with the reason saying the
  gaps are prefill chunks sharing steps with decodes: one more than the fleet that misses,
  grown as the rate grows until they are ready. A moderate fast burn while the slow window is
  within budget spends budget; it buys no worker.
- **learned factor**: each settled interval moves a per-pool factor on the model's load towards
  the slow window's miss share aimed at (``MISS_AIM`` of the budget): up while the slow window
  burns over the aim and the fast one still does, at once to the +1 on a miss both windows
  confirm, back down slowly to 1 (never under: the model plans for part of the budget, and a
  fleet that met the SLO says nothing about a smaller one under bursts) while the slow window
  is under the aim. Not from a fleet clearing an old queue, nor from a ramp (the window lags it).
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

from dynamod.daemon.planner.capacity import (
    MAX_UTILISATION,
    MISS_AIM,
    CapacityModel,
    Demand,
    Sized,
    ceil_replicas,
)
from dynamod.daemon.planner.forecast import Forecast, RateForecast
from dynamod.daemon.planner.policy import (
    Observation,
    PoolObservation,
    TrafficSample,
    WorkerLoad,
    fraction_over,
    osl_classes,
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

MIN_MISSES = 3  # fewer misses than this in the window are noise, not a trend
MIN_SAMPLES = 20  # requests (TTFT) or gaps (ITL) before a miss rate says anything
TREND_CAP = 1.5  # a projected rate at most this times the recent one
RAMP = 1.5  # the last interval's rate this much over the window's: demand is rising, do not learn
LEARN_UP_S = 30.0  # e-folding time of the learned factor's rise while misses exceed the aim
# Never under the model: it already plans for ``MISS_AIM`` of the budget. A fleet the model sized
# that met the SLO says nothing about a smaller one when the traffic comes in bursts (probing one
# fewer between bursts left one worker to meet the next burst's first start-up alone).
LEARNED_RANGE = (1.0, 4.0)


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
    # Evidence only: remembered by the scale-down window like a sustained need, but it launches
    # nothing (``strongest`` passes over it). A burst onset's carried rate: it holds the fleet
    # the measured level grew, it does not grow one.
    hold_only: bool = False


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
                 kv_block_size: int | None = None, startup_s: float = 30.0,
                 demand_window_s: float | None = None, slow_window_s: float | None = None,
                 learn_half_life_s: float = 90.0) -> None:
        self.model = model
        self.mode = mode
        self.interval_s = interval_s
        self.startup_s = startup_s
        # Demand and misses are read over a window (one start-up time, at least 6 intervals): one
        # 5 s interval of a heavy-tailed trace is mostly noise.
        self.demand_window_s = demand_window_s if demand_window_s is not None else max(startup_s, 6 * interval_s)
        self._recent: deque[tuple[float, TrafficSample]] = deque()
        # The error budget's slow window (the scale-down window: how long a fleet is held for),
        # per interval: (end, TTFT misses, requests with a first token, ITL misses, finished).
        self.slow_window_s = max(slow_window_s if slow_window_s is not None else 6.0 * startup_s,
                                 self.demand_window_s)
        self._burn: deque[tuple[float, float, float, float, float]] = deque()
        # Multiwindow, multi-burn-rate (the SRE practice): the slow window pairs with a low
        # threshold (the budget), the fast window alone with a high one. A fast window burning at
        # this many times the budget, kept up until a worker launched now is ready (the fast
        # window plus one start-up), spends the slow window's whole budget: waiting for the slow
        # window to agree would spend it.
        self.fast_burn_factor = max(1.0, self.slow_window_s / (self.demand_window_s + startup_s))
        self.short_rate = 0.0  # the last interval's arrivals per second
        self._first_at: float | None = None  # when the first sample began
        self.observed_s = 0.0  # seconds of traffic measured so far
        self.trend_rate = 0.0  # the window's rate carried to when a new worker would be ready
        self.window_rate = 0.0  # the window's arrivals per second, as measured
        # Agg: the growth of the arrivals over the last window and start-up, carried to when the
        # workers launched now and at the next decision are ready (``forecast.py``); ``rise`` is
        # what it adds to the window's rate, the headroom a fleet needs to meet a ramp.
        self._forecast = RateForecast(self.demand_window_s + startup_s)
        self.forecast: Forecast | None = None
        self.rise = 0.0
        self._rates: deque[tuple[float, float]] = deque()
        self.sustained_rate = 0.0
        # Agg, within one forecast span of a burst's onset: the rate measured since it (what the
        # fleet is sized for), and the carried rate it replaced (release-window evidence only).
        self._onset_at: float | None = None
        self.onset_level: float | None = None
        self.carried_rate = 0.0
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
        # The error budget: the share of requests that may miss (1 - the attainment aimed at).
        self.budget = model.error_budget
        self.isl: float | None = None
        self.osl: float | None = None
        self.osl_classes: tuple[tuple[float, float], ...] = ()  # the last measured output-length mix
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
            self._forecast.add(obs.now, t.duration_s, t.num_requests)
            self._burn.append((obs.now, *self._sample_misses(t)))
        while self._recent and self._recent[0][0] <= obs.now - self.demand_window_s:
            self._recent.popleft()
        while self._burn and self._burn[0][0] <= obs.now - self.slow_window_s:
            self._burn.popleft()
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
        self.window_rate = rate
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
        self.rise = self._rise(obs.now, rate)
        rate = max(self.trend_rate, self.window_rate + self.rise) if self.mode == "agg" else self.trend_rate
        self.sustained_rate = rate
        self.carried_rate = 0.0
        if self.mode == "agg":
            self.forecast = self._forecast.forecast(obs.now, self.startup_s + self.interval_s)
            if self.observed_s >= self.demand_window_s:  # the first window's rate is a guess, no evidence
                rate = max(rate, self.forecast.rate)
            self.onset_level = self._onset_level(obs.now, samples)
            if self.onset_level is not None and rate > self.onset_level:
                # A step's level is measured, not extrapolated: sized for it, the carried rate
                # kept as evidence only (``Need.hold_only``).
                level = self.onset_level
                self.carried_rate = self.sustained_rate
                self.trend_rate = min(self.trend_rate, level)
                self.rise = max(0.0, min(self.rise, level - self.window_rate))
                self.sustained_rate = min(self.sustained_rate, level)
                rate = level
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
        classes = tuple(osl_classes(_merge_buckets([s.osl_buckets for s in samples])))
        if classes:
            self.osl_classes = classes
        return Demand(rate, self.isl or 0.0, self.osl or 0.0, self.hit_rate, backlog * (1.0 - min(self.hit_rate, 0.95)),
                      self.osl_classes)

    def _onset_level(self, now: float, samples: list[TrafficSample]) -> float | None:
        """Within one forecast span of a burst's onset (``Forecast.onset``), the rate measured
        since it: the higher of the last two intervals' rate (the shortest mean that is not one
        interval's Poisson noise) and the recent half window's, never under the window's. None
        otherwise."""
        if self.forecast is not None and self.forecast.onset:
            self._onset_at = now
        if self._onset_at is None or now - self._onset_at > self._forecast.span_s:
            return None
        return max(self.window_rate, _rate_of(samples[len(samples) // 2:]), _rate_of(samples[-2:]))

    def _rise(self, now: float, rate: float) -> float:
        """How much the window's rate rose over the last start-up time: carried over the next one
        (``demand``), so the fleet a worker launched now completes meets the ramp instead of
        trailing it by a start-up. A robust trend: no significance test, no cap, nothing when
        the rate is flat or falling."""
        recent = [x for u, x in self._rates if u >= now - self.startup_s - 1e-9]
        if self.observed_s >= self.demand_window_s:  # the first window's rate is a guess, no evidence
            self._rates.append((now, rate))
        while self._rates and self._rates[0][0] <= now - self.startup_s - self.interval_s:
            self._rates.popleft()
        if not recent or self.observed_s < self.demand_window_s:
            return 0.0
        low = min(recent)
        rise = max(0.0, rate - low)
        # A ramp that grew by ``rate / low`` over the last start-up grows as fast over the next:
        # an accelerating ramp outruns a rise carried flat (a doubling per start-up needs the
        # fleet a start-up ahead). At most ``TREND_CAP`` times, as the trend is capped.
        return rise * min(rate / low, TREND_CAP) if low > 0 else rise

    def projected_backlog(self, demand: Demand, ready: int, thpt: float) -> float:
        """Prompt tokens still queued when a worker launched now is ready: today's queue plus
        what the last interval's rate adds beyond what the ready workers compute meanwhile."""
        inflow = self.short_rate * demand.isl * (1.0 - min(demand.hit_rate, 0.95))
        return max(0.0, demand.backlog_tokens + (inflow - ready * thpt) * self.startup_s)

    def missed(self, since: float = -math.inf) -> tuple[float | None, float | None, float, float, float, float]:
        """(share of requests over TTFT, share of requests over ITL, how many of each, how many
        requests in all) in the window, counting only intervals that ended after ``since``."""
        recent = [s for t, s in self._recent if t > since]
        ttft = _merge_buckets([s.ttft_buckets for s in recent])
        itl = _merge_buckets([s.itl_buckets for s in recent])
        osl = _merge_buckets([s.osl_buckets for s in recent])
        return _misses_of(ttft, itl, osl, self.model.ttft_ms, self.model.itl_ms)

    def _sample_misses(self, t: TrafficSample) -> tuple[float, float, float, float]:
        """(TTFT misses, requests with a first token, ITL misses, requests judged on ITL) of one
        interval, for the error budget's slow window."""
        t_over, i_over, t_n, i_n, t_total, i_total = _misses_of(t.ttft_buckets, t.itl_buckets, t.osl_buckets,
                                                                self.model.ttft_ms, self.model.itl_ms)
        return t_n, t_total, i_n, i_total

    def slow_burn(self) -> tuple[float | None, float | None, float, float]:
        """(TTFT miss share, ITL miss share, TTFT misses, ITL misses) over the slow window."""
        t_n = sum(b[1] for b in self._burn)
        t_total = sum(b[2] for b in self._burn)
        i_n = sum(b[3] for b in self._burn)
        i_total = sum(b[4] for b in self._burn)
        return (t_n / t_total if t_total > 0 else None, i_n / i_total if i_total > 0 else None, t_n, i_n)

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
                "rate_rise": round(self.rise, 4),
                **sized.as_inputs()}
        for name, value in (("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms)):
            if value is not None:
                base[name] = round(value, 3)
        if self.forecast is not None:
            base.update(self.forecast.as_inputs(), window_rate=round(self.window_rate, 4))
        if self.onset_level is not None:
            base.update(onset_level=round(self.onset_level, 4), carried_rate=round(self.carried_rate, 4))
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
            over = f"over the last {min(self.observed_s, self.demand_window_s):g} s"
            # The model's load is linear in the rate (the agg share does not depend on it): the
            # part the measured rate asks is sustained, what the forecast adds on top transient.
            measured = steady
            if demand.request_rate > self.sustained_rate > 0:
                scale = self.sustained_rate / demand.request_rate
                measured = max(ceil_replicas(load * scale * k), ceil_replicas(busy * scale / MAX_UTILISATION)
                               if pool != POOL_DECODE else 0)
            elif demand.request_rate > 0 and self.sustained_rate <= 0:
                measured = 0
            if measured < steady:
                needs.append(Need(pool, measured, R_CAPACITY, f"{over}: at the measured {self.sustained_rate:.3g} req/s "
                                  f"-> {measured}", inputs, transient=young))
                needs.append(Need(pool, steady, R_CAPACITY, f"{over}, the rate forecast when a worker launched now "
                                  f"is ready: {detail}", inputs, transient=True))
            else:
                needs.append(Need(pool, steady, R_CAPACITY, f"{over}: {detail}", inputs, transient=young))
            if self.carried_rate > self.sustained_rate and demand.request_rate > 0 and not young:
                scale = self.carried_rate / demand.request_rate
                held = max(ceil_replicas(load * scale * k),
                           ceil_replicas(busy * scale / MAX_UTILISATION) if pool != POOL_DECODE else 0)
                if held > measured:
                    needs.append(Need(pool, held, R_CAPACITY,
                                      f"{over}: a burst's onset, sized for the {self.onset_level:.3g} req/s measured "
                                      f"since it; the {self.carried_rate:.3g} req/s the rise carries over the start-up "
                                      f"holds {held} (remembered, launches nothing)", inputs, hold_only=True))
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
        slow_t, slow_i, slow_t_n, slow_i_n = self.slow_burn()
        inputs["error_budget"] = round(self.budget, 4)
        if slow_t is not None:
            inputs["slow_ttft_over_frac"] = round(slow_t, 4)
        if slow_i is not None:
            inputs["slow_itl_over_frac"] = round(slow_i, 4)
        # The share of this pool's requests missing, fast and slow: TTFT is the prefill pool's,
        # ITL the decode pool's, both the agg pool's (their sum bounds the requests missing either).
        judged = {POOL_PREFILL: (1.0, 0.0), POOL_DECODE: (0.0, 1.0)}.get(pool, (1.0, 1.0))
        fast = judged[0] * (ttft_over or 0.0) + judged[1] * (itl_over or 0.0)
        fast_n = judged[0] * ttft_n + judged[1] * itl_n
        fast_total = max(judged[0] * ttft_total, judged[1] * itl_total)
        slow = judged[0] * (slow_t or 0.0) + judged[1] * (slow_i or 0.0)
        window = (f"over the last {min(self.demand_window_s, obs.now - settled):g} s "
                  f"({slow:.1%} over the last {min(self.slow_window_s, self.observed_s):g} s, "
                  f"budget {self.budget:.1%})")
        # Two ways to burn (multiwindow, multi-burn-rate): both windows over the budget (the
        # misses are the fleet's now, and spend more than the budget over the horizon the fleet
        # is held for), or the fast window alone at ``fast_burn_factor`` x the budget (a burst or
        # a ramp the slow window lags by minutes: waiting for it would spend its whole budget).
        slow_burning = fast > self.budget and slow > self.budget
        fast_burning = fast > self.budget * self.fast_burn_factor
        burning = (slow_burning or fast_burning) and fast_n >= MIN_MISSES
        step = committed + 1
        if burning and self.window_rate > 0:
            # Sized for the demand when the new workers are ready: the fleet misses at the
            # window's rate, so one more than it, grown as the rate is growing (the rise or the
            # trend carried over the start-up).
            demand_rate = max(self.trend_rate, self.window_rate + self.rise)
            growth = demand_rate / self.window_rate
            step = max(step, ceil_replicas((committed + 1) * growth))
            inputs["burn_growth"] = round(growth, 3)
            inputs["burn_rate_ready"] = round(demand_rate, 4)
        inputs["fast_burn_threshold"] = round(self.budget * self.fast_burn_factor, 4)
        ttft_missed = burning and judged[0] > 0 and (ttft_over or 0.0) > 0 and \
            (pool == POOL_PREFILL or (ttft_over or 0.0) >= (itl_over or 0.0))
        itl_missed = burning and judged[1] > 0 and (itl_over or 0.0) > 0 and not ttft_missed
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
        aim = self.budget * MISS_AIM
        # Nor from a ramp: the window's rate lags a rising demand, and the misses are the lag's.
        ramping = self.short_rate > RAMP * self.window_rate
        if fast_total >= MIN_SAMPLES and load > 0 and not (queued and fresh) and not ramping:
            k = self.learned.get(pool, 1.0)
            ratio = slow / aim  # the learner follows the budget-relevant (slow) burn
            # Only misses at the size the model asks teach its factor: a fleet held larger by
            # something else (a queue, the predictive floor, a cold start's backlog still in the
            # slow window) says nothing about it, as for probing down.
            model_size = ceil_replicas(load * k)
            if out and slow_burning and committed <= model_size:
                k = max(k, step / load)  # the model now asks at least the +1
                # and never probes below where it just missed (that floor fades 10x slower,
                # so a changed traffic mix is probed again, but a constant one does not flap)
                self._k_floor[pool] = max(self._k_floor.get(pool, 0.0), step / load)
            elif ratio > 1.0 and fast > aim and committed <= model_size:  # over the aim, and still now
                k *= math.exp(self.interval_s / LEARN_UP_S * min(ratio - 1.0, 2.0))
            elif ratio <= 1.0 and fast <= self.budget and 1 < committed <= model_size:
                # Within the aim at the size the model asks: probe one fewer, slowly. (A fleet
                # held larger by something else says nothing about a smaller one, nor does a
                # single worker, which has no smaller fleet to probe.)
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
    """The largest need that may launch workers (not ``hold_only``); on a tie the most urgent
    reason (``REASON_ORDER``)."""
    def rank(n: Need) -> tuple[int, int]:
        order = REASON_ORDER.index(n.reason) if n.reason in REASON_ORDER else len(REASON_ORDER)
        return (n.replicas, -order)
    return max([n for n in needs if not n.hold_only] or needs, key=rank)


def _misses_of(ttft: tuple[tuple[float, float], ...], itl: tuple[tuple[float, float], ...],
               osl: tuple[tuple[float, float], ...], ttft_ms: float,
               itl_ms: float) -> tuple[float | None, float | None, float, float, float, float]:
    """(TTFT miss share, ITL miss share, TTFT misses, ITL misses, requests judged on each) from
    the frontends' histograms. ITL is judged per request (its mean), as the SLA is: long gaps
    spread over requests spoil the short ones (``request_itl_miss``, from the gap and output
    histograms). The share of long gaps stands in only without an output histogram: with one it
    overstates, since a long request averages its few long gaps away (in agg, 3 % of gaps being
    prefill steps is no 3 % of requests missing)."""
    t_over = fraction_over(ttft, ttft_ms)
    spread = request_itl_miss(itl, osl, itl_ms) if osl else None
    i_over = fraction_over(itl, itl_ms) if spread is None else spread
    t_total = ttft[-1][1] if ttft else 0.0
    i_total = (osl[-1][1] if osl else itl[-1][1]) if itl else 0.0
    return t_over, i_over, (t_over or 0.0) * t_total, (i_over or 0.0) * i_total, t_total, i_total


def _rate_of(samples: list[TrafficSample]) -> float:
    """Arrivals per second over the samples (0 without any)."""
    seconds = sum(s.duration_s for s in samples)
    return sum(finite(s.num_requests) or 0.0 for s in samples) / seconds if seconds > 0 else 0.0


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

