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
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from dynamod.daemon.planner.load_policy import ReplicaBudget, pools_for_mode
from dynamod.daemon.planner.perf_profile import PerfProfile
from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan, TrafficSample
from dynamod.daemon.planner.predictors import Predictor, PredictorConfig, make_predictor
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import (
    ACTION_HOLD,
    ACTION_SCALE_DOWN,
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

    def validate(self) -> SlaPolicyConfig:
        if self.mode not in ("disagg", "agg"):
            raise ConfigError(f"unknown planner mode {self.mode!r}; choose disagg or agg")
        if self.interval_s <= 0:
            raise ConfigError(f"--adjustment-interval must be > 0, got {self.interval_s}")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ConfigError(f"--ttft and --itl must be > 0 ms, got {self.ttft_ms} and {self.itl_ms}")
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
        self.interval_s = config.interval_s
        self.pools = pools_for_mode(config.mode)
        self._rate: Predictor = make_predictor(config.predictor)
        self._isl: Predictor = make_predictor(config.predictor)
        self._osl: Predictor = make_predictor(config.predictor)
        self.p_correction = 1.0
        self.d_correction = 1.0
        self._seen_traffic = False

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
        ready = {p: (observation.pools.get(p) or PoolObservation(pool=p, ready=0)).ready for p in self.pools}
        traffic = observation.traffic
        decode_pool = POOL_AGG if self.config.mode == "agg" else POOL_DECODE
        inputs: dict[str, float] = {}
        if traffic is not None and traffic.duration_s > 0:
            rate = traffic.num_requests / traffic.duration_s
            self._rate.add(rate)
            inputs["request_rate"] = rate
            inputs["num_requests"] = float(traffic.num_requests)
            if traffic.num_requests > 0:
                self._seen_traffic = True
                if traffic.isl is not None:
                    self._isl.add(traffic.isl)
                    inputs["isl"] = traffic.isl
                if traffic.osl is not None:
                    self._osl.add(traffic.osl)
                    inputs["osl"] = traffic.osl
                if traffic.ttft_ms is not None:
                    inputs["ttft_ms"] = traffic.ttft_ms
                if traffic.itl_ms is not None:
                    inputs["itl_ms"] = traffic.itl_ms
                self.p_correction, self.d_correction = self.correction_factors(traffic, ready[decode_pool])
        if not self._seen_traffic:
            return self._hold_all(ready, "no_traffic", "no request has finished yet: holding", inputs)
        rate, isl, osl = self._rate.predict(), self._isl.predict(), self._osl.predict()
        predicted = {"request_rate": rate, "isl": isl, "osl": osl}
        inputs["p_correction"] = self.p_correction
        inputs["d_correction"] = self.d_correction
        if isl <= 0 or osl <= 0:
            return self._hold_all(ready, "no_traffic", "no ISL/OSL measured yet", inputs, predicted)
        s = self.size(rate, isl, osl, self.p_correction, self.d_correction)
        raw = {POOL_AGG: s.decode_replicas} if self.config.mode == "agg" else \
            {POOL_PREFILL: s.prefill_replicas, POOL_DECODE: s.decode_replicas}
        return self._finish(raw, ready, s, inputs, predicted)

    def _finish(self, raw: dict[str, int], ready: dict[str, int], s: Sizing,
                inputs: dict[str, float], predicted: dict[str, float]) -> dict[str, PoolPlan]:
        budget, step = self.config.budget, self.config.max_scaling_step
        desired: dict[str, int] = {}
        why: dict[str, str] = {}
        for pool, n in raw.items():
            lo = budget.min_for(pool)
            m = max(n, lo)
            capped = min(max(m, ready[pool] - step), ready[pool] + step)
            capped = max(capped, lo)  # the floor may exceed one step (Dynamo: endpoint recovery)
            if m != n:
                why[pool] = "at_min"
            if capped != m:
                why[pool] = "max_scaling_step"
            desired[pool] = min(capped, budget.max_for(pool))
            if desired[pool] != capped:
                why[pool] = "at_max_budget"
        fitted = budget.fit_total(desired)
        for pool in fitted:
            if fitted[pool] != desired[pool]:
                why[pool] = "at_max_budget"
        plans: dict[str, PoolPlan] = {}
        for pool, n in fitted.items():
            action = ACTION_SCALE_UP if n > ready[pool] else ACTION_SCALE_DOWN if n < ready[pool] else ACTION_HOLD
            reason = why.get(pool, "sla_throughput")
            if pool == POOL_PREFILL:
                detail = (f"{s.request_rate:.3g} req/s x {s.isl:.0f} tok x min(1, p_corr {s.p_correction:.2f}) / "
                          f"{s.prefill_thpt_per_gpu:.0f} tok/s/GPU -> {raw[pool]}")
            else:
                phase = "agg (prefill + decode share)" if pool == POOL_AGG else "decode"
                detail = (f"{phase}: {s.request_rate:.3g} req/s x {s.osl:.0f} tok / {s.decode_thpt_per_gpu:.0f} tok/s/GPU "
                          f"at ITL {self.config.itl_ms:g}/{s.d_correction:.2f} ms -> {raw[pool]}")
            if n != raw[pool]:
                detail += f", {reason} -> {n}"
            pool_inputs = dict(inputs, ready=float(ready[pool]), raw_replicas=float(raw[pool]))
            plans[pool] = PoolPlan(pool, n, action, reason, detail, pool_inputs, dict(predicted))
        return plans

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
