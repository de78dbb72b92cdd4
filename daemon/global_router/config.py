"""The global router's grid config file: Dynamo's format, read from JSON (or YAML), checked up front.

Dynamo's global router reads one JSON file whose ``mode`` (default ``disagg``) says which pools
exist; the same files work here unchanged, and ``.yaml``/``.yml`` files are read as YAML::

    agg:    num_agg_pools, agg_pool_dynamo_namespaces, agg_pool_priorities?,
            agg_pool_selection_strategy {ttft_min_ms, ttft_max_ms, ttft_resolution, itl_min_ms,
            itl_max_ms, itl_resolution, [isl_min, isl_max, isl_resolution], agg_pool_mapping,
            priority_overrides?}
    disagg: num_prefill_pools, num_decode_pools, prefill_/decode_pool_dynamo_namespaces,
            prefill_/decode_pool_priorities?, prefill_pool_selection_strategy {isl_*, ttft_*,
            prefill_pool_mapping, priority_overrides?}, decode_pool_selection_strategy
            {context_length_*, itl_*, decode_pool_mapping, priority_overrides?}
    both:   enable_priority_retry (default false)

A mapping is indexed ``[isl][ttft]`` (prefill), ``[context_length][itl]`` (decode), ``[ttft][itl]``
(agg) or ``[isl][ttft][itl]`` (agg with all three ``isl_*`` keys). Pool priorities: lower is faster,
default the pool order (pool 0 fastest). ``priority_overrides`` rules ``{min_priority,
max_priority, target_pool}`` (inclusive bounds, first match wins) replace the grid's answer.

Every mistake an operator can make in this file is a ``ConfigError`` at startup that names the file
and the key, never a KeyError or an IndexError on the first request. Unlike Dynamo, unknown keys
are errors too: a misspelt ``ttft_resoluton`` would otherwise silently fall back to nothing. The
deprecated spellings Dynamo still reads (``ttft_min``, ``ttft_max``, ``itl_min``, ``itl_max``) are
accepted with a warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)

MODE_AGG = "agg"
MODE_DISAGG = "disagg"
MODES = (MODE_AGG, MODE_DISAGG)
STAGE_AGG = "agg"
STAGE_PREFILL = "prefill"
STAGE_DECODE = "decode"

_ALIASES = {"ttft_min": "ttft_min_ms", "ttft_max": "ttft_max_ms", "itl_min": "itl_min_ms", "itl_max": "itl_max_ms"}
_AGG_KEYS = ("num_agg_pools", "agg_pool_dynamo_namespaces", "agg_pool_priorities", "agg_pool_selection_strategy")
_DISAGG_KEYS = (
    "num_prefill_pools", "num_decode_pools", "prefill_pool_dynamo_namespaces", "decode_pool_dynamo_namespaces",
    "prefill_pool_priorities", "decode_pool_priorities", "prefill_pool_selection_strategy",
    "decode_pool_selection_strategy",
)  # fmt: skip


class PriorityOverride(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Requests whose priority lies in ``[min_priority, max_priority]`` go to ``target_pool``."""

    min_priority: int
    max_priority: int
    target_pool: int


class PrefillStrategy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """(input length, TTFT target) -> prefill pool."""

    isl_min: int
    isl_max: int
    isl_resolution: int
    ttft_min_ms: float
    ttft_max_ms: float
    ttft_resolution: int
    prefill_pool_mapping: list[list[int]]
    priority_overrides: list[PriorityOverride] = []


class DecodeStrategy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """(request token count, ITL target) -> decode pool (Dynamo keeps the ``context_length`` names)."""

    context_length_min: int
    context_length_max: int
    context_length_resolution: int
    itl_min_ms: float
    itl_max_ms: float
    itl_resolution: int
    decode_pool_mapping: list[list[int]]
    priority_overrides: list[PriorityOverride] = []


class AggStrategy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """(TTFT target, ITL target) -> pool, or (input length, TTFT, ITL) when all ``isl_*`` are set."""

    ttft_min_ms: float
    ttft_max_ms: float
    ttft_resolution: int
    itl_min_ms: float
    itl_max_ms: float
    itl_resolution: int
    agg_pool_mapping: list[Any]  # 2-D or 3-D: its shape is checked against the resolutions below
    isl_min: int | None = None
    isl_max: int | None = None
    isl_resolution: int | None = None
    priority_overrides: list[PriorityOverride] = []


Strategy = PrefillStrategy | DecodeStrategy | AggStrategy


class _GridFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The file as written; ``load_config`` turns it into a ``GlobalRouterConfig``."""

    mode: str = MODE_DISAGG
    enable_priority_retry: bool = False
    num_agg_pools: int | None = None
    agg_pool_dynamo_namespaces: list[str] | None = None
    agg_pool_priorities: list[int] | None = None
    agg_pool_selection_strategy: AggStrategy | None = None
    num_prefill_pools: int | None = None
    num_decode_pools: int | None = None
    prefill_pool_dynamo_namespaces: list[str] | None = None
    decode_pool_dynamo_namespaces: list[str] | None = None
    prefill_pool_priorities: list[int] | None = None
    decode_pool_priorities: list[int] | None = None
    prefill_pool_selection_strategy: PrefillStrategy | None = None
    decode_pool_selection_strategy: DecodeStrategy | None = None


@dataclass(frozen=True, slots=True)
class StagePools:
    """The pools one stage (``agg``, ``prefill`` or ``decode``) chooses among, and how."""

    stage: str
    namespaces: tuple[str, ...]
    priorities: tuple[int, ...]  # lower = faster; retries walk toward lower
    strategy: Strategy


@dataclass(frozen=True, slots=True)
class GlobalRouterConfig:
    mode: str
    enable_priority_retry: bool
    stages: dict[str, StagePools]  # agg mode: {"agg"}; disagg mode: {"prefill", "decode"}

    @property
    def namespaces(self) -> list[str]:
        """Every pool namespace once, in config order (what the console shows as the pools)."""
        out: list[str] = []
        for pools in self.stages.values():
            out.extend(ns for ns in pools.namespaces if ns not in out)
        return out

    def check_own_namespace(self, namespace: str) -> None:
        """A pool in the global router's own namespace would put its workers' model cards beside
        the global router's, and the frontend would route to both: refuse it."""
        if namespace in self.namespaces:
            raise ConfigError(
                f"pool namespace {namespace!r} is the global router's own namespace; pools need namespaces of their own"
            )


# -- loading ----------------------------------------------------------------------------------------


def load_config(path: str | Path) -> GlobalRouterConfig:
    """Reads and checks the grid config file; every problem is a ``ConfigError`` naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read global router config {path}: {exc.strerror or exc}") from None
    data = _parse(path, text)
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"global router config {path}: {exc}") from None


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path} is YAML but PyYAML is not installed; `pip install pyyaml` or use JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"global router config {path} is not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"global router config {path} is not valid JSON: {exc}") from None


def config_from_dict(data: Any) -> GlobalRouterConfig:
    """The checks of ``load_config`` on an already parsed document (tests, embedding)."""
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be an object, got {type(data).__name__}")
    data = _rename_aliases(data)
    mode = data.get("mode", MODE_DISAGG)
    if mode not in MODES:
        raise ConfigError(f"mode must be 'disagg' or 'agg', got {mode!r}")
    foreign = [k for k in (_DISAGG_KEYS if mode == MODE_AGG else _AGG_KEYS) if k in data]
    if foreign:
        raise ConfigError(f"{', '.join(foreign)} belong to the other mode; this config's mode is {mode!r}")
    try:
        raw = msgspec.convert(data, _GridFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc).replace("$.", "")) from None
    if mode == MODE_AGG:
        stages = {STAGE_AGG: _agg_stage(raw)}
    else:
        stages = {STAGE_PREFILL: _prefill_stage(raw), STAGE_DECODE: _decode_stage(raw)}
    return GlobalRouterConfig(mode=mode, enable_priority_retry=raw.enable_priority_retry, stages=stages)


def _rename_aliases(data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for key in ("prefill_pool_selection_strategy", "decode_pool_selection_strategy", "agg_pool_selection_strategy"):
        strategy = out.get(key)
        if not isinstance(strategy, dict):
            continue
        renamed = dict(strategy)
        for old, new in _ALIASES.items():
            if old in renamed:
                if new in renamed:
                    raise ConfigError(f"{key} has both {old!r} and {new!r}; keep {new!r}")
                logger.warning("global router config key deprecated key=%s.%s use=%s", key, old, new)
                renamed[new] = renamed.pop(old)
        out[key] = renamed
    return out


def _require(value: Any, key: str, mode: str) -> Any:
    if value is None:
        raise ConfigError(f"{key} is required in {mode} mode")
    return value


def _pools(raw: _GridFile, stage: str, mode: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    count = _require(getattr(raw, f"num_{stage}_pools"), f"num_{stage}_pools", mode)
    namespaces = _require(getattr(raw, f"{stage}_pool_dynamo_namespaces"), f"{stage}_pool_dynamo_namespaces", mode)
    if count < 1:
        raise ConfigError(f"num_{stage}_pools must be at least 1, got {count}")
    if len(namespaces) != count:
        raise ConfigError(
            f"num_{stage}_pools ({count}) does not match {stage}_pool_dynamo_namespaces length ({len(namespaces)})"
        )
    for i, ns in enumerate(namespaces):
        if not ns or "/" in ns or "." in ns:
            raise ConfigError(f"{stage}_pool_dynamo_namespaces[{i}] must be a name without '/' or '.', got {ns!r}")
    if len(set(namespaces)) != len(namespaces):
        raise ConfigError(f"{stage}_pool_dynamo_namespaces names a namespace twice: {namespaces}")
    priorities = getattr(raw, f"{stage}_pool_priorities")
    if priorities is None:
        priorities = list(range(count))  # Dynamo's default: pool order, pool 0 fastest
    elif len(priorities) != count:
        raise ConfigError(f"{stage}_pool_priorities length ({len(priorities)}) does not match num_{stage}_pools ({count})")
    return tuple(namespaces), tuple(priorities)


def _check_range(name: str, lo: float, hi: float, resolution: int) -> None:
    if resolution <= 0:
        raise ConfigError(f"{name}_resolution must be positive, got {resolution}")
    if lo >= hi:
        raise ConfigError(f"{name} minimum ({lo:g}) must be less than its maximum ({hi:g})")


def _check_grid(key: str, grid: Any, shape: Sequence[tuple[int, str]], pools: int) -> None:
    """``grid`` must be nested lists of the given (length, axis name) shape holding pool indices."""
    length, axis = shape[0]
    if not isinstance(grid, list):
        raise ConfigError(f"{key} must be a list (one entry per {axis} bucket), got {type(grid).__name__}")
    if len(grid) != length:
        raise ConfigError(f"{key} has {len(grid)} entries but {axis}_resolution is {length}")
    for i, cell in enumerate(grid):
        where = f"{key}[{i}]"
        if len(shape) > 1:
            _check_grid(where, cell, shape[1:], pools)
        elif not isinstance(cell, int) or isinstance(cell, bool):
            raise ConfigError(f"{where} must be a pool index (an integer), got {cell!r}")
        elif not 0 <= cell < pools:
            raise ConfigError(f"{where} is pool {cell}, but the pools are 0 to {pools - 1}")


def _check_overrides(key: str, overrides: list[PriorityOverride], pools: int) -> None:
    for i, rule in enumerate(overrides):
        if rule.min_priority > rule.max_priority:
            raise ConfigError(
                f"{key}.priority_overrides[{i}]: min_priority ({rule.min_priority}) must be <= max_priority ({rule.max_priority})"
            )
        if not 0 <= rule.target_pool < pools:
            raise ConfigError(
                f"{key}.priority_overrides[{i}]: target_pool {rule.target_pool} is not a pool (0 to {pools - 1})"
            )


def _agg_stage(raw: _GridFile) -> StagePools:
    namespaces, priorities = _pools(raw, STAGE_AGG, MODE_AGG)
    key = "agg_pool_selection_strategy"
    s: AggStrategy = _require(raw.agg_pool_selection_strategy, key, MODE_AGG)
    _check_range("ttft", s.ttft_min_ms, s.ttft_max_ms, s.ttft_resolution)
    _check_range("itl", s.itl_min_ms, s.itl_max_ms, s.itl_resolution)
    isl = (s.isl_min, s.isl_max, s.isl_resolution)
    shape = [(s.ttft_resolution, "ttft"), (s.itl_resolution, "itl")]
    if any(v is not None for v in isl):
        if s.isl_min is None or s.isl_max is None or s.isl_resolution is None:
            raise ConfigError(f"{key}: isl_min, isl_max and isl_resolution must be configured together")
        _check_range("isl", s.isl_min, s.isl_max, s.isl_resolution)
        shape.insert(0, (s.isl_resolution, "isl"))
    _check_grid(f"{key}.agg_pool_mapping", s.agg_pool_mapping, shape, len(namespaces))
    _check_overrides(key, s.priority_overrides, len(namespaces))
    return StagePools(STAGE_AGG, namespaces, priorities, s)


def _prefill_stage(raw: _GridFile) -> StagePools:
    namespaces, priorities = _pools(raw, STAGE_PREFILL, MODE_DISAGG)
    key = "prefill_pool_selection_strategy"
    s: PrefillStrategy = _require(raw.prefill_pool_selection_strategy, key, MODE_DISAGG)
    _check_range("isl", s.isl_min, s.isl_max, s.isl_resolution)
    _check_range("ttft", s.ttft_min_ms, s.ttft_max_ms, s.ttft_resolution)
    shape = [(s.isl_resolution, "isl"), (s.ttft_resolution, "ttft")]
    _check_grid(f"{key}.prefill_pool_mapping", s.prefill_pool_mapping, shape, len(namespaces))
    _check_overrides(key, s.priority_overrides, len(namespaces))
    return StagePools(STAGE_PREFILL, namespaces, priorities, s)


def _decode_stage(raw: _GridFile) -> StagePools:
    namespaces, priorities = _pools(raw, STAGE_DECODE, MODE_DISAGG)
    key = "decode_pool_selection_strategy"
    s: DecodeStrategy = _require(raw.decode_pool_selection_strategy, key, MODE_DISAGG)
    _check_range("context_length", s.context_length_min, s.context_length_max, s.context_length_resolution)
    _check_range("itl", s.itl_min_ms, s.itl_max_ms, s.itl_resolution)
    shape = [(s.context_length_resolution, "context_length"), (s.itl_resolution, "itl")]
    _check_grid(f"{key}.decode_pool_mapping", s.decode_pool_mapping, shape, len(namespaces))
    _check_overrides(key, s.priority_overrides, len(namespaces))
    return StagePools(STAGE_DECODE, namespaces, priorities, s)
