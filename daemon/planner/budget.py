"""The replica budget every planner sizes within: per-pool minimum and maximum, and the GPUs all
planned pools may use together (Dynamo's ``min_endpoint``, ``max_gpu_budget``,
``{prefill,decode}_engine_num_gpu``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import POOL_AGG, POOL_DECODE, POOL_PREFILL


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
