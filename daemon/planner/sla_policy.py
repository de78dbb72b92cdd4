"""The SLA (throughput) planner: sizes the pools for the traffic it predicts, from the profile.

Each interval, from the frontends' ``TrafficSample`` (Dynamo's SLA planner, 0.x
``planner_core.py`` ``observe_metrics`` / ``make_adjustments``; 1.x ``throughput_scaling.py``):

1. Correction factors: how far the live engines are from the profile.
   ``p_correction = observed_ttft / profile.ttft(isl)``;
   ``d_correction = observed_itl / profile.itl(kv_usage(concurrency), isl + osl / 2)``, the
   concurrency per decode replica by Little's law: ``request_rate * request_duration / replicas``
   with ``request_duration = ttft + itl * (osl - 1)``.
2. Predict the next interval's request rate, ISL and OSL (``predictors.py``).
3. Prefill replicas: ``ceil(rate * isl * min(1, p_correction) / thpt_per_gpu(isl) / gpus)``. Only a
   factor under 1 counts: a TTFT below the profile means prefix-cache hits (less work), while a TTFT
   above it is queueing, which the replica count itself cures.
4. Decode replicas: ``ceil(rate * osl / best_thpt_per_gpu(itl_target / d_correction, isl + osl / 2)
   / gpus)``: the highest per-GPU throughput whose ITL, corrected, meets the target.
5. Floors at the minimums, caps the change at ``max_scaling_step`` (Dynamo
   ``max_throughput_scaling_replicas``), fits the GPU budget (``scale = budget / total``; prefill
   ``floor(p * scale)``; decode the rest).

Agg mode sizes one pool that does both jobs, by time sharing (dynamod's rule; Dynamo 1.x fits a
regression instead): ``ceil(prefill_load + decode_load)`` where each load is the demand over one
engine's capacity for that phase, as in 3 and 4.

``size`` keeps those formulas (and the decision record shows them as ``dynamo_replicas``), but the
plan sizes from the ``CapacityModel`` instead: ``ceil(share)`` plans every engine at 100% busy, so
queueing alone misses TTFT, and in agg the prefill chunks sharing steps with decodes miss ITL long
before the engine is full. Two loops, as in Dynamo:

- the slow, predictive loop (every ``interval_s``, Dynamo's 180 s): the predicted rate, ISL and OSL
  through the capacity model (queueing headroom: prefill at the utilisation whose M/D/1 wait meets
  TTFT; agg prefill at the share of time whose chunks keep ITL) give each pool's floor;
- the fast, reactive loop (every ``reactive_interval_s``, 5 s): the shared ``ReactiveCore`` (this
  interval's demand and backlog, SLA misses, KV) may ask more than the floor at once.

The ``ScaleGuard`` releases only after a window of several start-up times (``hysteresis.py``).
The floor is a prediction, not evidence: it holds the pool while it stands, but the window
remembers only what the measured traffic needed (remembered, the first slow interval's guess --
made from the first 5 s: a 27k-token mean prompt and no prefix hits yet, against 9k and 15 %
later -- held 7 workers on the Mooncake trace until t = 455 s where 3 served: 5409
worker-seconds instead of 4333).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from dynamod.daemon.perf.profile import PerfProfile
from dynamod.daemon.planner.budget import ReplicaBudget, pools_for_mode
from dynamod.daemon.planner.capacity import (
    DEFAULT_ATTAINMENT,
    MAX_UTILISATION,
    CapacityModel,
    Demand,
    Sized,
    ceil_replicas,
)
from dynamod.daemon.planner.load_policy import DEFAULT_STARTUP_S, release_window
from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan, TrafficSample
from dynamod.daemon.planner.predictors import Predictor, PredictorConfig, make_predictor
from dynamod.daemon.planner.reactive import R_PREDICTED, KvThresholds, Need, ReactiveCore
from dynamod.daemon.planner.scaling import PoolSizer, action_of
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import (
    ACTION_HOLD,
    ACTION_SCALE_UP,
    POOL_AGG,
    POOL_DECODE,
    POOL_PREFILL,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SlaPolicyConfig:
    mode: str = "disagg"
    interval_s: float = 180.0  # Dynamo throughput_adjustment_interval_seconds
    budget: ReplicaBudget = field(default_factory=ReplicaBudget)
    ttft_ms: float = 500.0  # Dynamo SLAPlannerDefaults.ttft_ms
    itl_ms: float = 50.0  # Dynamo SLAPlannerDefaults.itl_ms
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    correction: bool = True
    max_scaling_step: int = 8  # Dynamo max_throughput_scaling_replicas
    reactive_interval_s: float = 5.0  # Dynamo load_adjustment_interval_seconds: the fast loop
    startup_s: float = DEFAULT_STARTUP_S
    scale_down_window_s: float | None = None
    grace_period_s: float = 60.0
    attainment_pct: float = 100.0 * DEFAULT_ATTAINMENT  # the SLO; 100 - it is the error budget

    @property
    def tick_s(self) -> float:
        """How often the policy is asked: the fast loop's interval (never slower than the slow one)."""
        return min(self.interval_s, self.reactive_interval_s) if self.reactive_interval_s > 0 else self.interval_s

    def validate(self) -> SlaPolicyConfig:
        if self.mode not in ("disagg", "agg"):
            raise ConfigError(f"unknown planner mode {self.mode!r}; choose disagg or agg")
        if self.interval_s <= 0:
            raise ConfigError(f"--adjustment-interval must be > 0, got {self.interval_s}")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ConfigError(f"--ttft and --itl must be > 0 ms, got {self.ttft_ms} and {self.itl_ms}")
        if self.reactive_interval_s < 0:
            raise ConfigError(f"--reactive-interval must be >= 0 (0: no fast loop), got {self.reactive_interval_s}")
        if self.startup_s < 0:
            raise ConfigError(f"--worker-startup-time must be >= 0, got {self.startup_s}")
        if not 50.0 <= self.attainment_pct < 100.0:
            raise ConfigError(f"--sla-attainment is a percentage in [50, 100), got {self.attainment_pct}")
        if self.max_scaling_step < 1:
            raise ConfigError(f"--max-throughput-scaling-replicas must be >= 1, got {self.max_scaling_step}")
        self.predictor.validate()
        return self


@dataclass(frozen=True, slots=True)
class Sizing:
    """The numbers behind one interval's answer, before the budget."""

    request_rate: float
    isl: float
    osl: float
    p_correction: float
    d_correction: float
    prefill_thpt_per_gpu: float
    decode_thpt_per_gpu: float
    prefill_replicas: int
    decode_replicas: int


def _ceil(x: float) -> int:
    """ceil that forgives float noise (3.0000000001 is 3)."""
    return math.ceil(x - 1e-9)


class SlaPolicy:
    """See the module docstring. Keeps three predictors (rate, ISL, OSL) and the last correction
    factors, which hold when an interval has no latency figures."""

    name = "sla"

    def __init__(self, config: SlaPolicyConfig, profile: PerfProfile) -> None:
        self.config = config.validate()
        self.profile = profile
        self.interval_s = config.tick_s
        self.pools = pools_for_mode(config.mode)
        self._rate: Predictor = make_predictor(config.predictor)
        self._isl: Predictor = make_predictor(config.predictor)
        self._osl: Predictor = make_predictor(config.predictor)
        self.p_correction = 1.0
        self.d_correction = 1.0
        self._seen_traffic = False
        b = config.budget
        self.model = CapacityModel(profile, mode=config.mode, ttft_ms=config.ttft_ms, itl_ms=config.itl_ms,
                                   prefill_gpus=b.prefill_engine_num_gpu, decode_gpus=b.decode_engine_num_gpu,
                                   attainment=config.attainment_pct / 100.0)
        up, down = 1.0, 0.6  # Dynamo's easy-mode throughput thresholds: KV demand the fast loop reacts to
        window = release_window(config.startup_s, config.scale_down_window_s, self.interval_s)
        # The error budget's slow window is the scale-down window: the horizon a fleet is held for.
        self.core = ReactiveCore(self.model, mode=config.mode, interval_s=self.interval_s, kv=KvThresholds(up, down),
                                 startup_s=config.startup_s, slow_window_s=window)
        self.sizer = PoolSizer(b, interval_s=self.interval_s, grace_s=config.grace_period_s, window_s=window)
        # The slow loop's interval so far: arrivals, seconds, and ISL/OSL/latency sums weighted by
        # the finished requests' count (approximated by arrivals where none finished).
        self._acc: list[TrafficSample] = []
        self._predicted_at: float | None = None
        self._floor: dict[str, int] = {}
        self._floor_detail: dict[str, str] = {}
        self._floor_inputs: dict[str, dict[str, float]] = {}
        self._predicted: dict[str, float] = {}

    @property
    def model_d_correction(self) -> float:
        """The decode correction the capacity model sizes with. In agg the measured mean ITL
        carries the prefill steps' stalls, which the model's agg prefill share already counts:
        correcting the decode step by it as well would count them twice (the share shrinks,
        the fleet doubles). Disaggregated decode steps carry no prefill: the correction holds."""
        return 1.0 if self.config.mode == "agg" else self.d_correction

    # ---- formulas (public: tests and the report check them) -----------------------------------

    def correction_factors(self, traffic: TrafficSample, decode_replicas: int) -> tuple[float, float]:
        """(p, d) from one interval's measured TTFT/ITL against the profile; a factor without its
        measurement keeps its last value."""
        p, d = self.p_correction, self.d_correction
        if not self.config.correction or traffic.isl is None or traffic.num_requests <= 0:
            return p, d
        isl = traffic.isl
        osl = traffic.osl or 1.0
        if traffic.ttft_ms is not None and traffic.ttft_ms > 0:
            expected = self.profile.prefill.ttft(isl)
            if expected > 0:
                p = traffic.ttft_ms / expected
        if traffic.itl_ms is not None and traffic.itl_ms > 0 and decode_replicas > 0 and traffic.duration_s > 0:
            rate = traffic.num_requests / traffic.duration_s
            duration_s = ((traffic.ttft_ms or 0.0) + traffic.itl_ms * max(0.0, osl - 1)) / 1000.0
            concurrency = rate * duration_s / decode_replicas
            expected = self.profile.decode.itl_at_concurrency(concurrency, isl + osl / 2)
            if expected > 0:
                d = traffic.itl_ms / expected
        return p, d

    def size(self, rate: float, isl: float, osl: float, p_corr: float, d_corr: float) -> Sizing:
        prof, cfg, budget = self.profile, self.config, self.config.budget
        p_thpt = prof.prefill.throughput_per_gpu(isl)
        prefill_demand = rate * isl * min(1.0, p_corr)  # prompt tokens / s
        corrected_itl = cfg.itl_ms / d_corr if d_corr > 0 else cfg.itl_ms
        d_thpt, _, _ = prof.decode.best_throughput_per_gpu(corrected_itl, isl + osl / 2)
        decode_demand = rate * osl  # output tokens / s
        if cfg.mode == "agg":
            share = prefill_demand / (p_thpt * budget.decode_engine_num_gpu) + \
                decode_demand / (d_thpt * budget.decode_engine_num_gpu)
            n = _ceil(share)
            return Sizing(rate, isl, osl, p_corr, d_corr, p_thpt, d_thpt, 0, n)
        num_p = _ceil(prefill_demand / p_thpt / budget.prefill_engine_num_gpu)
        num_d = _ceil(decode_demand / d_thpt / budget.decode_engine_num_gpu)
        return Sizing(rate, isl, osl, p_corr, d_corr, p_thpt, d_thpt, num_p, num_d)

    # ---- the interval --------------------------------------------------------------------------

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        now = observation.now
        ready = {p: (observation.pools.get(p) or PoolObservation(pool=p, ready=0)).ready for p in self.pools}
        traffic = observation.traffic
        if traffic is not None and traffic.duration_s > 0:
            self._acc.append(traffic)
            if traffic.num_requests > 0:
                self._seen_traffic = True
        if self._predicted_at is None or now - self._predicted_at >= self.config.interval_s - 1e-9:
            self._predict(observation, ready)
            self._predicted_at = now
        committed: dict[str, int] = {}
        pending: dict[str, bool] = {}
        for pool in self.pools:
            obs = observation.pools.get(pool) or PoolObservation(pool=pool, ready=0)
            committed[pool], pending[pool] = self.sizer.committed(pool, obs, now)
        needs, _demand, _sized = self.core.assess(observation, committed, d_correction=self.model_d_correction)
        for pool in self.pools:
            if pool in self._floor:
                inputs = needs[pool][0].inputs  # shared by the pool's needs: every record carries the floor
                inputs.update(p_correction=self.p_correction, d_correction=self.d_correction,
                              **self._floor_inputs.get(pool, {}))
                needs[pool].append(Need(pool, self._floor[pool], R_PREDICTED, self._floor_detail[pool], inputs,
                                       transient=True))
        if not self._seen_traffic and all(
                max(n.replicas for n in needs[p]) <= committed[p] for p in self.pools):
            inputs = dict(needs[self.pools[0]][0].inputs)
            return self._hold_all(ready, "no_traffic", "no request has arrived yet: holding", inputs)
        plans = self.sizer.plan(observation, needs, committed, pending, self._predicted)
        return self._cap_step(plans, committed)

    def _predict(self, observation: Observation, ready: dict[str, int]) -> None:
        """The slow loop: the accumulated interval into the predictors, the next interval's
        demand through the capacity model into each pool's floor."""
        acc, self._acc = self._acc, []
        decode_pool = POOL_AGG if self.config.mode == "agg" else POOL_DECODE
        if acc:
            merged = _merge(acc)
            self._rate.add(merged.num_requests / merged.duration_s)
            if merged.num_requests > 0:
                if merged.isl is not None:
                    self._isl.add(merged.isl)
                if merged.osl is not None:
                    self._osl.add(merged.osl)
                cold = any(w.ready_for_s is not None and w.ready_for_s < self.interval_s
                           for p in observation.pools.values() for w in p.loads)
                if not cold:  # a new worker's first interval is no measure of the engines
                    self.p_correction, self.d_correction = self.correction_factors(merged, ready.get(decode_pool, 0))
        if not self._seen_traffic:
            return
        rate, isl, osl = self._rate.predict(), self._isl.predict(), self._osl.predict()
        if not (isl > 0 and osl > 0):
            return
        self._predicted = {"request_rate": rate, "isl": isl, "osl": osl}
        demand = Demand(rate, isl, osl, self.core.hit_rate, osl_classes=self.core.osl_classes)
        sized = self.model.size(demand, d_correction=self.model_d_correction)
        dyn = self.size(rate, isl, osl, self.p_correction, self.d_correction)
        # The model as the SLA misses corrected it (``ReactiveCore.learned``), never under what
        # computes the predicted demand flat out.
        learned = {p: self.core.learned.get(p, 1.0) for p in self.pools}
        busy = demand.prefill_tokens_s / sized.prefill_thpt
        agg_n = max(ceil_replicas(sized.prefill_load * learned.get(POOL_AGG, 1.0)),
                    ceil_replicas((busy + sized.decode_load) / MAX_UTILISATION))
        pre_n = max(ceil_replicas(sized.prefill_load * learned.get(POOL_PREFILL, 1.0)),
                    ceil_replicas(busy / MAX_UTILISATION))
        dec_n = ceil_replicas(sized.decode_load * learned.get(POOL_DECODE, 1.0))
        sized = Sized(pre_n, agg_n if self.config.mode == "agg" else dec_n, sized.prefill_load, sized.decode_load,
                      sized.prefill_thpt, sized.decode_thpt, sized.prefill_cap, sized.backlog_s)
        if self.config.mode == "agg":
            self._floor = {POOL_AGG: sized.decode}
            self._floor_detail = {POOL_AGG: (
                f"predicted {rate:.3g} req/s x {isl:.0f} tok (hit {demand.hit_rate:.2f}) / {sized.prefill_thpt:.0f} tok/s "
                f"at most {sized.prefill_cap:.2f} of each worker's time, + {osl:.0f} tok / {sized.decode_thpt:.0f} tok/s "
                f"-> {sized.decode} (ceil(share) would say {dyn.decode_replicas})")}
        else:
            self._floor = {POOL_PREFILL: sized.prefill, POOL_DECODE: sized.decode}
            self._floor_detail = {
                POOL_PREFILL: (f"predicted {rate:.3g} req/s x {isl:.0f} tok (hit {demand.hit_rate:.2f}) / "
                               f"{sized.prefill_thpt:.0f} tok/s at utilisation {sized.prefill_cap:.2f} (M/D/1 wait "
                               f"within TTFT {self.config.ttft_ms:g} ms) -> {sized.prefill} "
                               f"(ceil(share) would say {dyn.prefill_replicas})"),
                POOL_DECODE: (f"predicted {rate:.3g} req/s x {osl:.0f} tok / {sized.decode_thpt:.0f} tok/s at ITL "
                              f"{self.config.itl_ms:g}/{self.d_correction:.2f} ms -> {sized.decode}"),
            }
        dyn_n = {POOL_AGG: dyn.decode_replicas} if self.config.mode == "agg" else \
            {POOL_PREFILL: dyn.prefill_replicas, POOL_DECODE: dyn.decode_replicas}
        self._floor_inputs = {p: {"predicted_floor": float(n), "dynamo_replicas": float(dyn_n[p]), **sized.as_inputs()}
                              for p, n in self._floor.items()}

    def _cap_step(self, plans: dict[str, PoolPlan], committed: dict[str, int]) -> dict[str, PoolPlan]:
        """Dynamo's ``max_throughput_scaling_replicas``: at most this many replicas per decision."""
        step = self.config.max_scaling_step
        out = {}
        for pool, plan in plans.items():
            lo = self.config.budget.min_for(pool)
            capped = max(min(plan.desired, committed[pool] + step), committed[pool] - step, lo)
            if capped != plan.desired:
                plan = PoolPlan(pool, capped, action_of(committed[pool], capped), "max_scaling_step",
                                f"{plan.reason} asked {plan.desired}, at most {step} per decision: {plan.detail}",
                                dict(plan.inputs), dict(plan.predicted))
            out[pool] = plan
        return out

    def _hold_all(self, ready: dict[str, int], reason: str, detail: str, inputs: dict[str, float],
                  predicted: dict[str, float] | None = None) -> dict[str, PoolPlan]:
        """Hold at the current counts, but never under the minimum (cold start with 0 ready)."""
        plans = {}
        for pool, n in ready.items():
            lo = self.config.budget.min_for(pool)
            if n < lo:
                plans[pool] = PoolPlan(pool, lo, ACTION_SCALE_UP, "below_min", f"{n} ready, minimum {lo}",
                                       dict(inputs, ready=float(n)), dict(predicted or {}))
            else:
                plans[pool] = PoolPlan(pool, n, ACTION_HOLD, reason, detail, dict(inputs, ready=float(n)),
                                       dict(predicted or {}))
        return plans


def _merge(samples: list[TrafficSample]) -> TrafficSample:
    """Several fast-loop samples as one slow-loop sample: arrivals and seconds add up, means are
    weighted by arrivals (the finished requests' count is not kept per sample)."""
    duration = sum(t.duration_s for t in samples)
    n = sum(t.num_requests for t in samples)

    def mean(attr: str) -> float | None:
        pairs = [(getattr(t, attr), max(t.num_requests, 1e-9)) for t in samples if getattr(t, attr) is not None]
        if not pairs:
            return None
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)

    return TrafficSample(duration_s=duration, num_requests=n, isl=mean("isl"), osl=mean("osl"),
                         ttft_ms=mean("ttft_ms"), itl_ms=mean("itl_ms"))

