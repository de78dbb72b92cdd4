"""The load-based planner: the fast reactive loop, on what the workers and frontends report now.

Every interval (Dynamo's ``load_adjustment_interval_seconds``, 5 s) the shared reactive core
(``reactive.py``) says what each pool needs: this interval's demand and the queued prompt tokens
through the capacity model (``capacity.py``: the profile's prefill throughput, the TTFT/ITL
targets), SLA misses from the frontends' histograms, and Dynamo's "easy mode" per-worker
thresholds (``planner/core/load_scaling.py``):

- prefill pool: each worker's queued prefill tokens (``active_prefill_tokens``). Targets
  ``throughput``/``latency`` compare ``queued / context_length`` with fixed ratios (up at 1.0/0.1,
  down under 0.1 / at 0); target ``load`` compares the raw tokens with
  ``--prefill-scale-{up,down}-queue-tokens``.
- decode and agg pools: each worker's KV demand ``(held blocks + queued blocks) / total blocks``.
  ``throughput`` scales up above 100% and down under 60%; ``latency`` above 40% and under 10%;
  ``load`` at ``--decode-scale-{up,down}-kv-rate`` percent. A pool may lose a worker only when
  the survivors would stay under the up threshold (``max * n / (n - 1) < up``).

The largest need wins; ``scaling.PoolSizer`` then applies the bounds, the start-up hysteresis
(``hysteresis.py``: up at once, down only after a release window of several start-up times) and
the GPU budget counted with starting and draining workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.planner.budget import ReplicaBudget, pools_for_mode
from dynamod.daemon.planner.capacity import DEFAULT_ATTAINMENT, CapacityModel
from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan
from dynamod.daemon.planner.reactive import R_QUEUE_HIGH, KvThresholds, Need, ReactiveCore
from dynamod.daemon.planner.scaling import PoolSizer
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import ACTION_HOLD, POOL_PREFILL

__all__ = ["OPTIMIZATION_TARGETS", "LoadPolicy", "LoadPolicyConfig", "ReplicaBudget", "pools_for_mode"]

log = logging.getLogger(__name__)

OPTIMIZATION_TARGETS = ("throughput", "latency", "load")

# (scale-up, scale-down) thresholds of Dynamo's easy mode, load_scaling.py.
PREFILL_RATIO_THRESHOLDS = {"throughput": (1.0, 0.1), "latency": (0.1, 0.0)}
DECODE_UTIL_THRESHOLDS = {"throughput": (1.0, 0.6), "latency": (0.4, 0.1)}

DEFAULT_STARTUP_S = 30.0  # a new worker's launch to ready, when nobody says
RELEASE_WINDOW_STARTUPS = 10.0  # shrink only after this many start-up times of evidence (bursts recur within it)


def release_window(startup_s: float, window_s: float | None, interval_s: float) -> float:
    """The scale-down evidence window: ``window_s`` when given, else a multiple of the start-up
    time (a worker released costs ``startup_s`` to bring back), at least two intervals."""
    if window_s is not None:
        return window_s
    return max(RELEASE_WINDOW_STARTUPS * startup_s, 2 * interval_s)


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
    ttft_ms: float = 2000.0
    itl_ms: float = 50.0
    startup_s: float = DEFAULT_STARTUP_S  # a new worker's launch to ready
    scale_down_window_s: float | None = None  # none: RELEASE_WINDOW_STARTUPS x startup_s
    attainment_pct: float = 100.0 * DEFAULT_ATTAINMENT  # the SLO; 100 - it is the error budget

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
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ConfigError(f"--ttft and --itl must be > 0 ms, got {self.ttft_ms} and {self.itl_ms}")
        if self.startup_s < 0:
            raise ConfigError(f"--worker-startup-time must be >= 0, got {self.startup_s}")
        if not 50.0 <= self.attainment_pct < 100.0:
            raise ConfigError(f"--sla-attainment is a percentage in [50, 100), got {self.attainment_pct}")
        if self.scale_down_window_s is not None and self.scale_down_window_s < 0:
            raise ConfigError(f"--scale-down-window must be >= 0, got {self.scale_down_window_s}")
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


class LoadPolicy:
    """See the module docstring."""

    name = "load"

    def __init__(self, config: LoadPolicyConfig, profile: PerfProfile | None = None) -> None:
        self.config = config.validate()
        self.interval_s = config.interval_s
        self.pools = pools_for_mode(config.mode)
        self.profile = profile or PerfProfile.load(default_profile_path())
        b = config.budget
        self.model = CapacityModel(self.profile, mode=config.mode, ttft_ms=config.ttft_ms, itl_ms=config.itl_ms,
                                   prefill_gpus=b.prefill_engine_num_gpu, decode_gpus=b.decode_engine_num_gpu,
                                   attainment=config.attainment_pct / 100.0)
        window = release_window(config.startup_s, config.scale_down_window_s, config.interval_s)
        # The error budget's slow window is the scale-down window: the horizon a fleet is held for.
        self.core = ReactiveCore(self.model, mode=config.mode, interval_s=config.interval_s,
                                 kv=self._kv_thresholds(), kv_block_size=config.kv_block_size,
                                 startup_s=config.startup_s, slow_window_s=window)
        self.sizer = PoolSizer(b, interval_s=config.interval_s, grace_s=config.grace_period_s, window_s=window)

    @property
    def ttft_ms(self) -> float:
        return self.config.ttft_ms

    @property
    def itl_ms(self) -> float:
        return self.config.itl_ms

    def _kv_thresholds(self) -> KvThresholds:
        cfg = self.config
        if cfg.optimization_target == "load":
            assert cfg.decode_scale_up_kv_rate is not None and cfg.decode_scale_down_kv_rate is not None
            return KvThresholds(cfg.decode_scale_up_kv_rate / 100.0, cfg.decode_scale_down_kv_rate / 100.0, True)
        up, down = DECODE_UTIL_THRESHOLDS[cfg.optimization_target]
        return KvThresholds(up, down, False)

    def set_model(self, *, context_length: int | None = None, kv_block_size: int | None = None) -> None:
        """What the workers' model card says, for the daemon to pass once it has read it; a flag
        given on the command line wins."""
        if self.config.context_length is None and context_length:
            self.config.context_length = int(context_length)
        if self.config.kv_block_size is None and kv_block_size:
            self.config.kv_block_size = int(kv_block_size)
            self.core.kv_block_size = self.config.kv_block_size

    # ---- decision ------------------------------------------------------------------------------

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        now = observation.now
        committed: dict[str, int] = {}
        pending: dict[str, bool] = {}
        for pool in self.pools:
            obs = observation.pools.get(pool) or PoolObservation(pool=pool, ready=0)
            committed[pool], pending[pool] = self.sizer.committed(pool, obs, now)
        silent = [p for p in self.pools if _silent(observation, p)]
        needs, _demand, _sized = self.core.assess(observation, committed)
        for pool in self.pools:
            queue = self._prefill_queue_need(observation, pool)
            if queue is not None:
                needs[pool].append(queue)
        plans = self.sizer.plan(observation, needs, committed, pending)
        for pool in silent:
            ready = observation.pools[pool].ready
            if plans[pool].desired <= ready:
                plans[pool] = PoolPlan(pool, ready, ACTION_HOLD, "no_load_data",
                                       f"no load reports from {ready} ready workers and no traffic figures",
                                       inputs={"ready": float(ready)})
        return plans

    def _prefill_queue_need(self, observation: Observation, pool: str) -> Need | None:
        """Dynamo's easy-mode prefill rule: any worker's queued prompt tokens over the threshold
        (a share of the context length, or ``--prefill-scale-up-queue-tokens``) adds one."""
        if pool != POOL_PREFILL:
            return None
        obs = observation.pools.get(pool) or PoolObservation(pool=pool, ready=0)
        if not obs.loads:
            return None
        cfg = self.config
        tokens = [float(w.active_prefill_tokens) for w in obs.loads]
        if cfg.optimization_target == "load":
            assert cfg.prefill_scale_up_queue_tokens is not None
            values, up, label = tokens, float(cfg.prefill_scale_up_queue_tokens), "prefill_queue_tokens"
        elif cfg.context_length:
            values = [t / cfg.context_length for t in tokens]
            up, label = PREFILL_RATIO_THRESHOLDS[cfg.optimization_target][0], "prefill_queue_ratio"
        else:
            return None  # the backlog sizing still counts the queue; the ratio needs the context length
        worst = max(values)
        if worst < up:
            return None
        over = sum(v >= up for v in values)
        return Need(pool, obs.ready + 1, R_QUEUE_HIGH,
                    f"{over}/{len(values)} workers over the scale-up threshold: max {label} {worst:.3f} "
                    f"(up {up:g}, target {cfg.optimization_target})", {label + "_max": worst, "ready": float(obs.ready)})


def _silent(observation: Observation, pool: str) -> bool:
    """Ready workers, yet neither load reports nor traffic: the event plane is not reaching the
    planner, which is no evidence the pool is idle."""
    obs = observation.pools.get(pool)
    return obs is not None and obs.ready > 0 and not obs.loads and observation.traffic is None

