"""KV router settings: Dynamo's flag names and defaults, with ``DYN_ROUTER_*`` env fallbacks.

Resolution order is CLI flag, then environment variable, then default (as in shared/config.py);
``--help`` shows each flag's variable and default. ``--kv-overlap-score-weight`` also answers to
Dynamo's newer spelling ``--router-kv-overlap-score-weight``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynamod.shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class KvRouterConfig:
    overlap_score_weight: float = 1.0  # weight of prefill blocks against decode blocks in the cost
    host_cache_hit_weight: float = 0.75  # credit for a prompt block found only in host memory (0..1)
    disk_cache_hit_weight: float = 0.25  # credit for a prompt block found only on disk (0..1)
    router_temperature: float = 0.0  # 0: lowest cost wins; > 0: softmax sampling over costs
    use_kv_events: bool = True  # False: approximate mode (routed blocks assumed cached for a TTL)
    router_ttl_secs: float = 120.0  # approximate mode: how long routed blocks count as cached
    router_max_tree_size: int = 1 << 20  # approximate mode: prune when the index holds more blocks
    router_prune_target_ratio: float = 0.8  # approximate mode: prune down to this share of the max
    router_replica_sync: bool = False  # publish/apply active-sequence changes between routers
    active_decode_blocks_threshold: float | None = None  # busy above this KV-block share (0..1)
    active_prefill_tokens_threshold: int | None = None  # busy above this many queued prefill tokens
    router_queue_size: int = 1024  # requests that may wait while every worker is busy
    router_queue_timeout_secs: float = 30.0  # then OverloadedError
    router_priority_jump_secs: float = 1.0  # queue place gained per priority point (wait_queue.py)
    router_active_sequence_ttl_secs: float = 600.0  # forget an active request never freed
    router_load_max_age_secs: float = 10.0  # load metrics older than this fall back to own counts

    def validate(self) -> KvRouterConfig:
        if self.overlap_score_weight < 0:
            raise ConfigError(f"--kv-overlap-score-weight must be >= 0, got {self.overlap_score_weight}")
        for flag, w in (
            ("--router-host-cache-hit-weight", self.host_cache_hit_weight),
            ("--router-disk-cache-hit-weight", self.disk_cache_hit_weight),
        ):
            if not 0.0 <= w <= 1.0:  # also rejects NaN
                raise ConfigError(f"{flag} must be within [0, 1], got {w}")
        if self.router_temperature < 0:
            raise ConfigError(f"--router-temperature must be >= 0, got {self.router_temperature}")
        if self.router_ttl_secs <= 0:
            raise ConfigError(f"--router-ttl-secs must be > 0, got {self.router_ttl_secs}")
        if self.router_max_tree_size <= 0:
            raise ConfigError(f"--router-max-tree-size must be > 0, got {self.router_max_tree_size}")
        if not 0.0 <= self.router_prune_target_ratio <= 1.0:
            raise ConfigError(f"--router-prune-target-ratio must be within [0, 1], got {self.router_prune_target_ratio}")
        t = self.active_decode_blocks_threshold
        if t is not None and not 0.0 <= t <= 1.0:
            raise ConfigError(f"--active-decode-blocks-threshold is a share of KV blocks within [0, 1], got {t}")
        p = self.active_prefill_tokens_threshold
        if p is not None and p < 0:
            raise ConfigError(f"--active-prefill-tokens-threshold must be >= 0, got {p}")
        if self.router_queue_size < 0:
            raise ConfigError(f"--router-queue-size must be >= 0, got {self.router_queue_size}")
        if self.router_queue_timeout_secs < 0:
            raise ConfigError(f"--router-queue-timeout-secs must be >= 0, got {self.router_queue_timeout_secs}")
        if not (math.isfinite(self.router_priority_jump_secs) and self.router_priority_jump_secs >= 0):
            raise ConfigError(f"--router-priority-jump-secs must be a finite number >= 0, got {self.router_priority_jump_secs}")
        if self.router_active_sequence_ttl_secs <= 0:
            raise ConfigError("--router-active-sequence-ttl-secs must be > 0")
        if self.router_load_max_age_secs <= 0:
            raise ConfigError("--router-load-max-age-secs must be > 0")
        return self

    @property
    def busy_detection(self) -> bool:
        return self.active_decode_blocks_threshold is not None or self.active_prefill_tokens_threshold is not None


def prefill_router_config(config: KvRouterConfig) -> KvRouterConfig:
    """A prefill pool's router: no busy skipping (the disaggregation policy decides what a busy
    prefill worker means) and no replica sync (the prompts it counts as queued on a worker live
    only as long as their prefill attempt; other replicas see them in the worker's own load)."""
    return dataclasses.replace(
        config, active_decode_blocks_threshold=None, active_prefill_tokens_threshold=None, router_replica_sync=False
    )


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


# field -> (flags, env variable, parser, help). Defaults come from KvRouterConfig.
_OPTIONS: dict[str, tuple[tuple[str, ...], str, Callable[[str], Any], str]] = {
    "overlap_score_weight": (
        ("--kv-overlap-score-weight", "--router-kv-overlap-score-weight"),
        "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
        float,
        "weight of prefill cost against decode load; higher favours cache reuse (TTFT), 0 ignores the cache",
    ),
    "host_cache_hit_weight": (
        ("--router-host-cache-hit-weight",),
        "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",
        float,
        "credit (0..1) for prompt blocks a worker holds only in host memory (offloaded KV), "
        "after its device prefix; 1 counts them as cached, 0 as uncached",
    ),
    "disk_cache_hit_weight": (
        ("--router-disk-cache-hit-weight",),
        "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",
        float,
        "credit (0..1) for prompt blocks a worker holds only on its disk tier, after its device and host prefix",
    ),
    "router_temperature": (
        ("--router-temperature",),
        "DYN_ROUTER_TEMPERATURE",
        float,
        "softmax temperature over worker costs; 0 always picks the lowest cost",
    ),
    "router_ttl_secs": (
        ("--router-ttl-secs",),
        "DYN_ROUTER_TTL_SECS",
        float,
        "without KV events: seconds a routed prompt counts as cached on its worker",
    ),
    "router_max_tree_size": (
        ("--router-max-tree-size",),
        "DYN_ROUTER_MAX_TREE_SIZE",
        int,
        "without KV events: prune the index when it holds more blocks than this",
    ),
    "router_prune_target_ratio": (
        ("--router-prune-target-ratio",),
        "DYN_ROUTER_PRUNE_TARGET_RATIO",
        float,
        "without KV events: prune down to this share of --router-max-tree-size",
    ),
    "active_decode_blocks_threshold": (
        ("--active-decode-blocks-threshold",),
        "DYN_ROUTER_ACTIVE_DECODE_BLOCKS_THRESHOLD",
        float,
        "a worker whose active KV blocks exceed this share (0..1) of its blocks is busy and skipped",
    ),
    "active_prefill_tokens_threshold": (
        ("--active-prefill-tokens-threshold",),
        "DYN_ROUTER_ACTIVE_PREFILL_TOKENS_THRESHOLD",
        int,
        "a worker with more active prefill tokens than this is busy and skipped",
    ),
    "router_queue_size": (
        ("--router-queue-size",),
        "DYN_ROUTER_QUEUE_SIZE",
        int,
        "requests that may wait while every worker is busy; beyond it requests get 503",
    ),
    "router_queue_timeout_secs": (
        ("--router-queue-timeout-secs",),
        "DYN_ROUTER_QUEUE_TIMEOUT_SECS",
        float,
        "how long a request waits for a non-busy worker before 503",
    ),
    "router_priority_jump_secs": (
        ("--router-priority-jump-secs",),
        "DYN_ROUTER_PRIORITY_JUMP_SECS",
        float,
        "queue place a request gains per point of nvext.agent_hints.priority, as if it had arrived "
        "this many seconds earlier (negative priorities: later); 0 queues plain FIFO",
    ),
    "router_active_sequence_ttl_secs": (
        ("--router-active-sequence-ttl-secs",),
        "DYN_ROUTER_ACTIVE_SEQUENCE_TTL_SECS",
        float,
        "forget a routed request that was never freed after this many seconds",
    ),
    "router_load_max_age_secs": (
        ("--router-load-max-age-secs",),
        "DYN_ROUTER_LOAD_MAX_AGE_SECS",
        float,
        "load metrics older than this are ignored in favour of the router's own counts",
    ),
}
_BOOL_OPTIONS: dict[str, tuple[str, str, str]] = {
    "use_kv_events": (
        "--router-kv-events",
        "DYN_ROUTER_USE_KV_EVENTS",
        "index workers' KV events; --no-router-kv-events predicts caches from routing decisions",
    ),
    "router_replica_sync": (
        "--router-replica-sync",
        "DYN_ROUTER_REPLICA_SYNC",
        "share active-sequence state with the other routers of the pool",
    ),
}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Adds the KV router flags (defaults None so env and defaults resolve in config_from_args)."""
    defaults = KvRouterConfig()
    g = parser.add_argument_group("KV router")
    for field_name, (flags, env, parse, text) in _OPTIONS.items():
        default = getattr(defaults, field_name)
        shown = "off" if default is None else default
        g.add_argument(*flags, dest=field_name, type=parse, default=None, help=f"{text} [env {env}, default {shown}]")
    for field_name, (flag, env, text) in _BOOL_OPTIONS.items():
        default = getattr(defaults, field_name)
        g.add_argument(
            flag,
            dest=field_name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{text} [env {env}, default {'on' if default else 'off'}]",
        )


def config_from_args(ns: argparse.Namespace) -> KvRouterConfig:
    """Flag, else ``DYN_ROUTER_*`` variable, else the default; validated."""
    values: dict[str, Any] = {}
    for field_name, (_flags, env, parse, _text) in _OPTIONS.items():
        values[field_name] = _resolve(ns, field_name, env, parse)
    for field_name, (_flag, env, _text) in _BOOL_OPTIONS.items():
        values[field_name] = _resolve(ns, field_name, env, _parse_bool)
    return KvRouterConfig(**{k: v for k, v in values.items() if v is not None}).validate()


def _resolve(ns: argparse.Namespace, field_name: str, env: str, parse: Callable[[str], Any]) -> Any:
    value = getattr(ns, field_name, None)
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None or text == "":
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise ConfigError(f"{env}={text!r}: {exc}") from exc
