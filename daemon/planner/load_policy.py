"""The load-based planner: reacts to what the workers report now, one replica at a time.

Dynamo's "easy mode" load scaling (``planner/core/load_scaling.py``, ``_prefill_easy_decision``,
``_decode_easy_decision``, ``_agg_easy_decision``), on dynamod's ``kv_metrics`` load reports:

- prefill pool: each worker's queued prefill tokens (``active_prefill_tokens``). Targets
  ``throughput``/``latency`` compare ``queued / context_length`` with fixed ratios (up at 1.0/0.1,
  down under 0.1 / at 0); target ``load`` compares the raw tokens with
  ``--prefill-scale-{up,down}-queue-tokens``.
- decode and agg pools: each worker's KV demand ``(held blocks + queued blocks) / total blocks``,
  where queued blocks are the waiting requests at the running ones' mean size and, for agg, the
  queued prompt tokens in blocks (Dynamo: ``(scheduled_kv + queued_kv [+ queued_prefill]) /
  max_kv``). ``throughput`` scales up above 100% and down under 60%; ``latency`` above 40% and
  under 10%; ``load`` at ``--decode-scale-{up,down}-kv-rate`` percent.

Scale up by one when ANY worker is over the up threshold; down by one when EVERY worker is under the
down threshold and the survivors would not cross the up threshold at once (Dynamo's
``_consolidation_safe_easy_target``: ``max * n / (n - 1) < up``). After a change the pool is held
while the new count is not yet ready (Dynamo's "scaling in progress" block), at most
``grace_period_s``. Then the min/max replicas and the GPU budget clamp the answer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan, WorkerLoad
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

OPTIMIZATION_TARGETS = ("throughput", "latency", "load")

# (scale-up, scale-down) thresholds of Dynamo's easy mode, load_scaling.py.
PREFILL_RATIO_THRESHOLDS = {"throughput": (1.0, 0.1), "latency": (0.1, 0.0)}
DECODE_UTIL_THRESHOLDS = {"throughput": (1.0, 0.6), "latency": (0.4, 0.1)}


def pools_for_mode(mode: str) -> tuple[str, ...]:
    return (POOL_AGG,) if mode == "agg" else (POOL_PREFILL, POOL_DECODE)


@dataclass(frozen=True, slots=True)
class ReplicaBudget:
    """Min/max replicas per pool and the GPU budget shared by the planned pools (Dynamo's
    ``min_endpoint``, ``max_gpu_budget``, ``{prefill,decode}_engine_num_gpu``; ``max_replicas``
    is dynamod's per-pool cap, 0 for none). The minimum wins over the budget, as in Dynamo,
    where the endpoint floor is a hard invariant."""

    prefill_min: int = 1
    decode_min: int = 1
    max_replicas: int = 0
    max_gpu_budget: int = 8
    prefill_engine_num_gpu: int = 1
    decode_engine_num_gpu: int = 1

    def validate(self) -> ReplicaBudget:
        if self.prefill_min < 0 or self.decode_min < 0:
            raise ConfigError("--min-endpoint must be >= 0")
        if self.max_replicas < 0:
            raise ConfigError("--max-replicas must be >= 0 (0: no per-pool limit)")
        if self.max_replicas and self.max_replicas < max(self.prefill_min, self.decode_min):
            raise ConfigError(f"--max-replicas {self.max_replicas} is below the minimum replicas")
        if self.prefill_engine_num_gpu < 1 or self.decode_engine_num_gpu < 1:
            raise ConfigError("--prefill-engine-num-gpu and --decode-engine-num-gpu must be >= 1")
        return self

    def min_for(self, pool: str) -> int:
        return self.prefill_min if pool == POOL_PREFILL else self.decode_min

    def gpus_for(self, pool: str) -> int:
        return self.prefill_engine_num_gpu if pool == POOL_PREFILL else self.decode_engine_num_gpu

    def max_for(self, pool: str) -> int:
        """The most replicas of ``pool`` alone: the per-pool cap and the whole GPU budget."""
        cap = self.max_replicas if self.max_replicas > 0 else 1 << 30
        if self.max_gpu_budget > 0:
            cap = min(cap, self.max_gpu_budget // self.gpus_for(pool))
        return max(cap, self.min_for(pool))

    def clamp(self, pool: str, desired: int) -> tuple[int, str]:
        """``desired`` within [min, max] for one pool, and ``at_min``/``at_max_budget`` when it moved."""
        lo, hi = self.min_for(pool), self.max_for(pool)
        if desired < lo:
            return lo, "at_min"
        if desired > hi:
            return hi, "at_max_budget"
        return desired, ""

    def gpus(self, counts: dict[str, int]) -> int:
        return sum(n * self.gpus_for(p) for p, n in counts.items())

    def fit_total(self, desired: dict[str, int]) -> dict[str, int]:
        """Scale the pools down together until they fit the GPU budget: Dynamo's throughput
        planner rule (``scale = budget / total``; prefill ``floor(p * scale)``, decode gets what is
        left), floors at the minimums. Single pools and unlimited budgets pass through."""
        if self.max_gpu_budget <= 0 or self.gpus(desired) <= self.max_gpu_budget:
            return dict(desired)
        out = dict(desired)
        if POOL_PREFILL in out and POOL_DECODE in out:
            scale = self.max_gpu_budget / self.gpus(desired)
            p = max(self.prefill_min, math.floor(out[POOL_PREFILL] * scale))
            left = self.max_gpu_budget - p * self.prefill_engine_num_gpu
            d = max(self.decode_min, left // self.decode_engine_num_gpu)
            out[POOL_PREFILL], out[POOL_DECODE] = p, d
            return out
        for pool in out:
            out[pool] = min(out[pool], self.max_for(pool))
        return out


@dataclass(slots=True)
class LoadPolicyConfig:
    mode: str = "disagg"
    interval_s: float = 5.0  # Dynamo load_adjustment_interval_seconds
    budget: ReplicaBudget = field(default_factory=ReplicaBudget)
    optimization_target: str = "throughput"  # Dynamo optimization_target default
    prefill_scale_up_queue_tokens: int | None = None
    prefill_scale_down_queue_tokens: int | None = None
    decode_scale_up_kv_rate: float | None = None  # percent
    decode_scale_down_kv_rate: float | None = None
    grace_period_s: float = 60.0
    context_length: int | None = None
    kv_block_size: int | None = None

    def validate(self) -> LoadPolicyConfig:
        if self.mode not in ("disagg", "agg"):
            raise ConfigError(f"unknown planner mode {self.mode!r}; choose disagg or agg")
        if self.optimization_target not in OPTIMIZATION_TARGETS:
            raise ConfigError(
                f"unknown --optimization-target {self.optimization_target!r}; choose one of {', '.join(OPTIMIZATION_TARGETS)}")
        if self.interval_s <= 0:
            raise ConfigError(f"--adjustment-interval must be > 0, got {self.interval_s}")
        if self.grace_period_s < 0:
            raise ConfigError(f"--scale-up-grace-period must be >= 0, got {self.grace_period_s}")
        if self.optimization_target == "load":
            needed = ["--decode-scale-up-kv-rate", "--decode-scale-down-kv-rate"]
            values: list[float | int | None] = [self.decode_scale_up_kv_rate, self.decode_scale_down_kv_rate]
            if self.mode == "disagg":
                needed += ["--prefill-scale-up-queue-tokens", "--prefill-scale-down-queue-tokens"]
                values += [self.prefill_scale_up_queue_tokens, self.prefill_scale_down_queue_tokens]
            missing = [n for n, v in zip(needed, values, strict=True) if v is None]
            if missing:
                raise ConfigError(f"--optimization-target load needs {', '.join(missing)}")
            for name, rate in (("up", self.decode_scale_up_kv_rate), ("down", self.decode_scale_down_kv_rate)):
                if rate is not None and not 0 <= rate <= 100:
                    raise ConfigError(f"--decode-scale-{name}-kv-rate is a percentage (0-100), got {rate}")
        for name, value in (("--context-length", self.context_length), ("--kv-block-size", self.kv_block_size)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        return self


@dataclass(slots=True)
class _Pending:
    target: int
    since: float


class LoadPolicy:
    """See the module docstring. Keeps, per pool, the change it is waiting for."""

    name = "load"

    def __init__(self, config: LoadPolicyConfig) -> None:
        self.config = config.validate()
        self.interval_s = config.interval_s
        self.pools = pools_for_mode(config.mode)
        self._pending: dict[str, _Pending] = {}

    def set_model(self, *, context_length: int | None = None, kv_block_size: int | None = None) -> None:
        """What the workers' model card says, for the daemon to pass once it has read it; a flag
        given on the command line wins."""
        if self.config.context_length is None and context_length:
            self.config.context_length = int(context_length)
        if self.config.kv_block_size is None and kv_block_size:
            self.config.kv_block_size = int(kv_block_size)

    # ---- decision ------------------------------------------------------------------------------

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        plans: dict[str, PoolPlan] = {}
        for pool in self.pools:
            obs = observation.pools.get(pool) or PoolObservation(pool=pool, ready=0)
            plans[pool] = self._plan_pool(pool, obs, observation.now)
        plans = self._fit_budget(plans, observation)
        for pool, plan in plans.items():
            ready = (observation.pools.get(pool) or PoolObservation(pool=pool, ready=0)).ready
            if plan.desired != ready and plan.reason != "grace_period":
                self._pending[pool] = _Pending(plan.desired, observation.now)
        return plans

    def _plan_pool(self, pool: str, obs: PoolObservation, now: float) -> PoolPlan:
        budget = self.config.budget
        ready = obs.ready
        lo = budget.min_for(pool)
        pending = self._pending.get(pool)
        if pending is not None:
            if ready == pending.target:
                del self._pending[pool]
            elif now - pending.since < self.config.grace_period_s:
                return PoolPlan(
                    pool, pending.target, ACTION_HOLD, "grace_period",
                    f"waiting for {pending.target} ready (have {ready}) since {now - pending.since:.0f}s, "
                    f"grace {self.config.grace_period_s:g}s",
                    inputs={"ready": float(ready)})
            else:
                log.warning("planner=load pool=%s target=%d ready=%d grace expired", pool, pending.target, ready)
                del self._pending[pool]
        if ready < lo:
            return PoolPlan(pool, lo, ACTION_SCALE_UP, "below_min", f"{ready} ready, minimum {lo}",
                            inputs={"ready": float(ready)})
        loads = [w for w in obs.loads if w.total_blocks > 0 or pool == POOL_PREFILL]
        if not loads:
            return PoolPlan(pool, ready, ACTION_HOLD, "no_load_data", f"no load reports from {ready} ready workers",
                            inputs={"ready": float(ready)})
        measured = self._measure(pool, loads)
        if measured is None:
            return PoolPlan(pool, ready, ACTION_HOLD, "insufficient_data",
                            "context length unknown: pass --context-length or let the daemon read the model card",
                            inputs={"ready": float(ready)})
        values, up, down, label = measured
        inputs = self._inputs(loads, ready)
        inputs[f"{label}_max"] = max(values)
        worst = max(values)
        thresholds = f"(up {up:g}, down {down:g}, target {self.config.optimization_target})"
        up_kind = "queue_high" if pool == POOL_PREFILL else "kv_usage_high"
        down_kind = "queue_low" if pool == POOL_PREFILL else "kv_usage_low"
        # Dynamo: prefill and the "load" target compare with >= / <=, decode with > / <.
        inclusive = pool == POOL_PREFILL or self.config.optimization_target == "load"
        over = [v >= up if inclusive else v > up for v in values]
        if any(over):
            n = sum(over)
            return PoolPlan(pool, ready + 1, ACTION_SCALE_UP, up_kind,
                            f"{n}/{len(values)} workers over the scale-up threshold: max {label} {worst:.3f} {thresholds}",
                            inputs=inputs)
        under = all((v <= down) if (inclusive or down == 0.0) else (v < down) for v in values)
        if under and ready > lo:
            if worst * ready / (ready - 1) >= up:
                return PoolPlan(pool, ready, ACTION_HOLD, "consolidation_guard",
                                f"all under {down:g} but {ready - 1} workers would carry {label} "
                                f"{worst * ready / (ready - 1):.3f} >= {up:g}", inputs=inputs)
            return PoolPlan(pool, ready - 1, ACTION_SCALE_DOWN, down_kind,
                            f"all {len(values)} workers under the scale-down threshold: max {label} {worst:.3f} {thresholds}",
                            inputs=inputs)
        reason = "at_min" if under else "within_thresholds"
        return PoolPlan(pool, ready, ACTION_HOLD, reason,
                        f"max {label} {worst:.3f} {thresholds}, {ready} ready (min {lo})", inputs=inputs)

    def _measure(self, pool: str, loads: list[WorkerLoad]) -> tuple[list[float], float, float, str] | None:
        """Per-worker signal and the (up, down) thresholds in its unit, or None when a needed model
        figure (context length) is unknown."""
        cfg = self.config
        target = cfg.optimization_target
        if pool == POOL_PREFILL:
            tokens = [float(w.active_prefill_tokens) for w in loads]
            if target == "load":
                assert cfg.prefill_scale_up_queue_tokens is not None and cfg.prefill_scale_down_queue_tokens is not None
                return tokens, float(cfg.prefill_scale_up_queue_tokens), float(cfg.prefill_scale_down_queue_tokens), \
                    "prefill_queue_tokens"
            if not cfg.context_length:
                return None
            up, down = PREFILL_RATIO_THRESHOLDS[target]
            return [t / cfg.context_length for t in tokens], up, down, "prefill_queue_ratio"
        values = [self._kv_demand(w, agg=pool == POOL_AGG) for w in loads]
        if target == "load":
            assert cfg.decode_scale_up_kv_rate is not None and cfg.decode_scale_down_kv_rate is not None
            return values, cfg.decode_scale_up_kv_rate / 100.0, cfg.decode_scale_down_kv_rate / 100.0, "kv_demand"
        up, down = DECODE_UTIL_THRESHOLDS[target]
        return values, up, down, "kv_demand"

    def _kv_demand(self, w: WorkerLoad, *, agg: bool) -> float:
        """(held + queued) KV blocks over the worker's total, Dynamo's decode/agg utilisation."""
        held = max(float(w.active_decode_blocks), w.kv_usage * w.total_blocks)
        per_request = held / w.num_running if w.num_running else 0.0
        queued = w.num_waiting * per_request
        if agg and self.config.kv_block_size:
            queued += w.active_prefill_tokens / self.config.kv_block_size
        return (held + queued) / w.total_blocks

    @staticmethod
    def _inputs(loads: list[WorkerLoad], ready: int) -> dict[str, float]:
        n = len(loads)
        return {
            "ready": float(ready),
            "kv_usage": sum(w.kv_usage for w in loads) / n,
            "kv_usage_max": max(w.kv_usage for w in loads),
            "num_waiting": float(sum(w.num_waiting for w in loads)),
            "num_running": float(sum(w.num_running for w in loads)),
            "prefill_queue_tokens": float(sum(w.active_prefill_tokens for w in loads)),
        }

    # ---- budget --------------------------------------------------------------------------------

    def _fit_budget(self, plans: dict[str, PoolPlan], observation: Observation) -> dict[str, PoolPlan]:
        """Per-pool min/max, then the shared GPU budget: a scale-up that would exceed it is
        refused (the pool holds with ``at_max_budget``) rather than taken from another pool."""
        budget = self.config.budget
        out: dict[str, PoolPlan] = {}
        for pool, plan in plans.items():
            desired, why = budget.clamp(pool, plan.desired)
            out[pool] = plan if not why or desired == plan.desired else _replace(plan, desired, why, observation)
        counts = {p: pl.desired for p, pl in out.items()}
        if budget.max_gpu_budget > 0 and budget.gpus(counts) > budget.max_gpu_budget:
            for pool, plan in out.items():
                ready = (observation.pools.get(pool) or PoolObservation(pool=pool, ready=0)).ready
                if plan.desired > ready and plan.reason != "below_min":
                    out[pool] = _replace(plan, max(ready, budget.min_for(pool)), "at_max_budget", observation)
            counts = {p: pl.desired for p, pl in out.items()}
            fitted = budget.fit_total(counts)
            for pool, n in fitted.items():
                if n != counts[pool]:
                    out[pool] = _replace(out[pool], n, "at_max_budget", observation)
        return out


def _replace(plan: PoolPlan, desired: int, reason: str, observation: Observation) -> PoolPlan:
    ready = (observation.pools.get(plan.pool) or PoolObservation(pool=plan.pool, ready=0)).ready
    action = ACTION_SCALE_UP if desired > ready else ACTION_SCALE_DOWN if desired < ready else ACTION_HOLD
    detail = f"{plan.reason} asked {plan.desired}, budget allows {desired}: {plan.detail}"
    return PoolPlan(plan.pool, desired, action, reason, detail, dict(plan.inputs), dict(plan.predicted))
