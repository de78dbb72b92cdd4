"""The planner policies' flags and the factory that turns them into a ``PlannerPolicy``.

One place for every policy flag so the planner daemon (``dynamod --role planner``), ``dynamod up
--planner`` and ``dynamod replay --planner`` offer the same names, defaults and ``DYN_*``
fallbacks (CLI wins, then the environment, then the default printed by ``--help``). Names and
defaults follow NVIDIA Dynamo's planner (``planner/config/defaults.py``), with dynamod aliases
where the issue asks for them (``--min-workers``/``--max-workers``).

Stable API (other roles import exactly these): ``add_policy_args(parser_or_group)``,
``build_policy(args) -> PlannerPolicy``, ``PLANNERS``, ``MODES``, ``PREDICTORS``.
"""

from __future__ import annotations

import argparse
from typing import Any

from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.planner.capacity import DEFAULT_ATTAINMENT
from dynamod.daemon.planner.load_policy import (
    DEFAULT_STARTUP_S,
    OPTIMIZATION_TARGETS,
    LoadPolicy,
    LoadPolicyConfig,
    ReplicaBudget,
)
from dynamod.daemon.planner.policy import PlannerPolicy
from dynamod.shared.config import env_or
from dynamod.shared.errors import ConfigError

PLANNERS = ("load", "sla")
MODES = ("disagg", "agg")
PREDICTORS = ("constant", "moving-average", "kalman", "arima")

# Dynamo: load_adjustment_interval_seconds = 5, throughput_adjustment_interval_seconds = 180.
DEFAULT_LOAD_INTERVAL_S = 5.0
DEFAULT_SLA_INTERVAL_S = 180.0
DEFAULT_TTFT_MS = 500.0  # Dynamo SLAPlannerDefaults
DEFAULT_ATTAINMENT_PCT = 100.0 * DEFAULT_ATTAINMENT
DEFAULT_ITL_MS = 50.0


def _env_default(env: str, default: object, kind: type) -> Any:
    """The flag's default: the environment's value when set, parsed like the flag, else ``default``.
    A malformed variable is a ``ConfigError`` naming it (not a traceback at parse time)."""
    raw = env_or(env, "")
    if raw == "":
        return default
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {env}={raw!r} is not a valid {kind.__name__}") from exc


def _add(group: Any, *flags: str, env: str, default: object, kind: type, help: str, **kw: Any) -> None:
    shown = "none" if default is None else default
    if kind is bool:
        group.add_argument(*flags, action="store_true", default=_env_default(env, default, bool),
                           help=f"{help} [env {env}, default {'on' if default else 'off'}]", **kw)
        return
    group.add_argument(*flags, type=kind, default=_env_default(env, default, kind),
                       help=f"{help} [env {env}, default {shown}]", **kw)


def add_policy_args(parser: argparse.ArgumentParser | Any) -> None:
    """Adds every policy flag to ``parser`` (an ``ArgumentParser`` or an argument group; groups
    are created on the parser when it has ``add_argument_group``)."""
    mk = parser.add_argument_group if hasattr(parser, "add_argument_group") else (lambda *_a, **_k: parser)
    g = mk("planner policy")
    _add(g, "--planner", env="DYN_PLANNER", default="load", kind=str, choices=PLANNERS,
         help="load: scale by one per interval from the workers' KV usage and queues; sla: size the pools "
              "from predicted traffic and the performance profile to meet --ttft/--itl")
    _add(g, "--mode", env="DYN_PLANNER_MODE", default="disagg", kind=str, choices=MODES,
         help="disagg: size the prefill and decode pools; agg: size the one agg pool")
    _add(g, "--adjustment-interval", env="DYN_PLANNER_ADJUSTMENT_INTERVAL", default=None, kind=float,
         metavar="SECONDS",
         help=f"seconds between decisions (none: Dynamo's {DEFAULT_LOAD_INTERVAL_S:g} for load, "
              f"{DEFAULT_SLA_INTERVAL_S:g} for sla)")
    b = mk("planner budget")
    _add(b, "--min-endpoint", "--min-replicas", "--min-workers", dest="min_endpoint", env="DYN_PLANNER_MIN_ENDPOINT",
         default=1, kind=int, help="fewest replicas of each pool")
    _add(b, "--prefill-min-endpoint", env="DYN_PLANNER_PREFILL_MIN_ENDPOINT", default=None, kind=int,
         help="fewest prefill replicas (none: --min-endpoint)")
    _add(b, "--decode-min-endpoint", env="DYN_PLANNER_DECODE_MIN_ENDPOINT", default=None, kind=int,
         help="fewest decode (or agg) replicas (none: --min-endpoint)")
    _add(b, "--max-replicas", "--max-workers", dest="max_replicas", env="DYN_PLANNER_MAX_REPLICAS", default=0, kind=int,
         help="most replicas of each pool; 0: only the GPU budget limits")
    _add(b, "--max-gpu-budget", env="DYN_PLANNER_MAX_GPU_BUDGET", default=8, kind=int,
         help="most GPUs all planned pools may use together; 0 or less: no GPU limit")
    _add(b, "--prefill-engine-num-gpu", env="DYN_PLANNER_PREFILL_ENGINE_NUM_GPU", default=1, kind=int,
         help="GPUs one prefill replica uses")
    _add(b, "--decode-engine-num-gpu", env="DYN_PLANNER_DECODE_ENGINE_NUM_GPU", default=1, kind=int,
         help="GPUs one decode (or agg) replica uses")
    ld = mk("load planner (--planner load)")
    _add(ld, "--optimization-target", env="DYN_PLANNER_OPTIMIZATION_TARGET", default="throughput", kind=str,
         choices=OPTIMIZATION_TARGETS,
         help="throughput: scale up when a prefill queue reaches the context length or decode KV demand 100%%, "
              "down below 10%% / 60%%; latency: up at 10%% / 40%%, down at 0 / 10%%; load: the four thresholds below")
    _add(ld, "--prefill-scale-up-queue-tokens", env="DYN_PLANNER_PREFILL_SCALE_UP_QUEUE_TOKENS", default=None,
         kind=int, help="queued prefill tokens on any worker that add a prefill replica (target load)")
    _add(ld, "--prefill-scale-down-queue-tokens", env="DYN_PLANNER_PREFILL_SCALE_DOWN_QUEUE_TOKENS", default=None,
         kind=int, help="queued prefill tokens at or under which, on every worker, one is removed (target load)")
    _add(ld, "--decode-scale-up-kv-rate", env="DYN_PLANNER_DECODE_SCALE_UP_KV_RATE", default=None, kind=float,
         help="KV demand %% (0-100) on any worker that adds a decode/agg replica (target load)")
    _add(ld, "--decode-scale-down-kv-rate", env="DYN_PLANNER_DECODE_SCALE_DOWN_KV_RATE", default=None, kind=float,
         help="KV demand %% (0-100) at or under which, on every worker, one is removed (target load)")
    _add(ld, "--scale-up-grace-period", env="DYN_PLANNER_SCALE_UP_GRACE_PERIOD", default=60.0, kind=float,
         metavar="SECONDS",
         help="after a change, hold the pool until its new count is ready, for at most this long")
    _add(ld, "--worker-startup-time", env="DYN_PLANNER_WORKER_STARTUP_TIME", default=None, kind=float,
         metavar="SECONDS",
         help="a new worker's launch to ready; the scale-down hysteresis is a multiple of it (none: 30, "
              "or --startup-delay in a replay)")
    _add(ld, "--scale-down-window", env="DYN_PLANNER_SCALE_DOWN_WINDOW", default=None, kind=float, metavar="SECONDS",
         help="shrink a pool only when the smaller fleet would have sufficed for this long (none: 10 x the "
              "worker start-up time)")
    _add(ld, "--context-length", env="DYN_PLANNER_CONTEXT_LENGTH", default=None, kind=int,
         help="model context length for the prefill queue ratio (none: the workers' model card)")
    _add(ld, "--kv-block-size", env="DYN_PLANNER_KV_BLOCK_SIZE", default=None, kind=int,
         help="tokens per KV block, to count queued prompts as KV demand (none: the model card)")
    s = mk("SLA targets and the SLA planner (--planner sla; both planners scale on TTFT/ITL misses)")
    _add(s, "--ttft", env="DYN_PLANNER_TTFT", default=DEFAULT_TTFT_MS, kind=float, metavar="MS", help="TTFT target in ms")
    _add(s, "--itl", env="DYN_PLANNER_ITL", default=DEFAULT_ITL_MS, kind=float, metavar="MS", help="ITL target in ms")
    _add(s, "--sla-attainment", env="DYN_PLANNER_SLA_ATTAINMENT", default=DEFAULT_ATTAINMENT_PCT, kind=float,
         metavar="PCT",
         help="the SLO: percent of requests within both --ttft and --itl the planner aims at; "
              "the rest is its error budget. Misses add workers only when they burn the budget faster than it "
              "allows over both a fast window (one start-up time) and a slow one (the scale-down window); the "
              "capacity model plans for 2/3 of the budget")
    _add(s, "--profile", env="DYN_PLANNER_PROFILE", default=None, kind=str, metavar="PATH",
         help="performance profile JSON from `dynamod profile`, both planners' capacity model "
              "(none: the shipped mocker profile)")
    _add(s, "--load-predictor", env="DYN_PLANNER_LOAD_PREDICTOR", default="arima", kind=str, choices=PREDICTORS,
         help="how the next interval's request count, ISL and OSL are predicted")
    _add(s, "--load-predictor-log1p", env="DYN_PLANNER_LOAD_PREDICTOR_LOG1P", default=False, kind=bool,
         help="model log(1+x) instead of x (spiky series; arima and kalman)")
    _add(s, "--prediction-window", env="DYN_PLANNER_PREDICTION_WINDOW", default=10, kind=int,
         help="intervals the moving-average predictor averages")
    _add(s, "--kalman-q-level", env="DYN_PLANNER_KALMAN_Q_LEVEL", default=1.0, kind=float,
         help="Kalman process noise of the level")
    _add(s, "--kalman-q-trend", env="DYN_PLANNER_KALMAN_Q_TREND", default=0.1, kind=float,
         help="Kalman process noise of the trend")
    _add(s, "--kalman-r", env="DYN_PLANNER_KALMAN_R", default=10.0, kind=float, help="Kalman measurement noise")
    _add(s, "--kalman-min-points", env="DYN_PLANNER_KALMAN_MIN_POINTS", default=5, kind=int,
         help="points before the Kalman filter predicts (the last value until then)")
    _add(s, "--no-correction", env="DYN_PLANNER_NO_CORRECTION", default=False, kind=bool,
         help="do not correct the profile by observed TTFT/ITL")
    _add(s, "--reactive-interval", env="DYN_PLANNER_REACTIVE_INTERVAL", default=5.0, kind=float, metavar="SECONDS",
         help="the SLA planner's fast loop: seconds between reactive decisions on live load and SLA misses "
              "(--adjustment-interval is its slow, predictive loop); 0: the slow loop only")
    _add(s, "--max-throughput-scaling-replicas", env="DYN_PLANNER_MAX_THROUGHPUT_SCALING_REPLICAS", default=8,
         kind=int, help="largest change of one pool in one SLA decision")


def _get(args: argparse.Namespace, name: str, default: Any) -> Any:
    """Attribute or default: a caller may build ``args`` by hand with only the flags it cares for."""
    value = getattr(args, name, None)
    return default if value is None else value


def _profile(args: argparse.Namespace) -> PerfProfile:
    return PerfProfile.load(_get(args, "profile", default_profile_path()))


def budget_from_args(args: argparse.Namespace) -> ReplicaBudget:
    min_endpoint = int(_get(args, "min_endpoint", 1))
    return ReplicaBudget(
        prefill_min=int(_get(args, "prefill_min_endpoint", min_endpoint)),
        decode_min=int(_get(args, "decode_min_endpoint", min_endpoint)),
        max_replicas=int(_get(args, "max_replicas", 0)),
        max_gpu_budget=int(_get(args, "max_gpu_budget", 8)),
        prefill_engine_num_gpu=int(_get(args, "prefill_engine_num_gpu", 1)),
        decode_engine_num_gpu=int(_get(args, "decode_engine_num_gpu", 1)),
    ).validate()


def build_policy(args: argparse.Namespace) -> PlannerPolicy:
    """The policy the flags describe. Raises ``ConfigError`` (one line for the CLI) on a bad
    combination, a missing profile or a predictor whose library is not installed."""
    planner = _get(args, "planner", "load")
    mode = _get(args, "mode", "disagg")
    if planner not in PLANNERS:
        raise ConfigError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}")
    if mode not in MODES:
        raise ConfigError(f"unknown planner mode {mode!r}; choose one of {', '.join(MODES)}")
    budget = budget_from_args(args)
    if planner == "load":
        interval = float(_get(args, "adjustment_interval", DEFAULT_LOAD_INTERVAL_S))
        return LoadPolicy(LoadPolicyConfig(
            mode=mode,
            interval_s=interval,
            budget=budget,
            optimization_target=_get(args, "optimization_target", "throughput"),
            prefill_scale_up_queue_tokens=getattr(args, "prefill_scale_up_queue_tokens", None),
            prefill_scale_down_queue_tokens=getattr(args, "prefill_scale_down_queue_tokens", None),
            decode_scale_up_kv_rate=getattr(args, "decode_scale_up_kv_rate", None),
            decode_scale_down_kv_rate=getattr(args, "decode_scale_down_kv_rate", None),
            grace_period_s=float(_get(args, "scale_up_grace_period", 60.0)),
            context_length=getattr(args, "context_length", None),
            kv_block_size=getattr(args, "kv_block_size", None),
            ttft_ms=float(_get(args, "ttft", DEFAULT_TTFT_MS)),
            itl_ms=float(_get(args, "itl", DEFAULT_ITL_MS)),
            startup_s=float(_get(args, "worker_startup_time", DEFAULT_STARTUP_S)),
            scale_down_window_s=getattr(args, "scale_down_window", None),
            attainment_pct=float(_get(args, "sla_attainment", DEFAULT_ATTAINMENT_PCT)),
        ).validate(), _profile(args))
    from dynamod.daemon.planner.predictors import PredictorConfig
    from dynamod.daemon.planner.sla_policy import SlaPolicy, SlaPolicyConfig

    interval = float(_get(args, "adjustment_interval", DEFAULT_SLA_INTERVAL_S))
    profile = _profile(args)
    predictor = PredictorConfig(
        kind=_get(args, "load_predictor", "arima"),
        log1p=bool(_get(args, "load_predictor_log1p", False)),
        window=int(_get(args, "prediction_window", 10)),
        kalman_q_level=float(_get(args, "kalman_q_level", 1.0)),
        kalman_q_trend=float(_get(args, "kalman_q_trend", 0.1)),
        kalman_r=float(_get(args, "kalman_r", 10.0)),
        kalman_min_points=int(_get(args, "kalman_min_points", 5)),
    ).validate()
    return SlaPolicy(SlaPolicyConfig(
        mode=mode,
        interval_s=interval,
        budget=budget,
        ttft_ms=float(_get(args, "ttft", DEFAULT_TTFT_MS)),
        itl_ms=float(_get(args, "itl", DEFAULT_ITL_MS)),
        predictor=predictor,
        correction=not bool(_get(args, "no_correction", False)),
        max_scaling_step=int(_get(args, "max_throughput_scaling_replicas", 8)),
        reactive_interval_s=float(_get(args, "reactive_interval", 5.0)),
        startup_s=float(_get(args, "worker_startup_time", DEFAULT_STARTUP_S)),
        scale_down_window_s=getattr(args, "scale_down_window", None),
        grace_period_s=float(_get(args, "scale_up_grace_period", 60.0)),
        attainment_pct=float(_get(args, "sla_attainment", DEFAULT_ATTAINMENT_PCT)),
    ).validate(), profile)
