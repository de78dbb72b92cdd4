"""Conditional disaggregation: prefill a request on the prefill pool, or locally on its decode worker.

Dynamo's policies, flags and defaults (``--router-conditional-disagg`` turns it on,
``--router-conditional-disagg-config`` is a JSON object with the fields of ``DisaggPolicyConfig``):

- ``isl_bounding``: local when the effective input length (prompt tokens minus the prefix the
  chosen *decode* worker already caches) is below ``eff_isl_threshold`` (2048) AND the effective
  over raw ratio is below ``eff_isl_ratio_threshold`` (0.7): little left to compute, much reused.
- ``prefill_load``: local when the chosen prefill worker is above ``prefill_busy_threshold``.
- ``isl_or_load``: local when either holds.
- ``decode_busy_threshold`` (off by default) guards all three: when the chosen decode worker's
  projected active KV blocks exceed this fraction of its capacity, prefill stays remote.

Without the flag every request with a prefill pool goes remote (``always``). With no prefill
worker the request is prefilled locally (``no_prefill_workers``) unless ``--decode-fallback`` is off.
The decision is pure: callers gather the numbers (routers, replay) and record the ``DisaggInfo``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.routing import DISAGG_LOCAL, DISAGG_REMOTE, DisaggInfo

POLICY_ALWAYS = "always"
POLICY_ISL_BOUNDING = "isl_bounding"
POLICY_PREFILL_LOAD = "prefill_load"
POLICY_ISL_OR_LOAD = "isl_or_load"
POLICIES = (POLICY_ISL_BOUNDING, POLICY_PREFILL_LOAD, POLICY_ISL_OR_LOAD)

REASON_ALWAYS = "always"
REASON_NO_PREFILL_WORKERS = "no_prefill_workers"
REASON_ISL_BOUNDING = "isl_bounding"
REASON_PREFILL_BUSY = "prefill_busy"
REASON_PREFILL_NOT_BUSY = "prefill_not_busy"
REASON_DECODE_BUSY = "decode_busy"
REASON_ISL_ABOVE = "isl_above_threshold"
REASON_PREFILL_FAILED = "prefill_failed"

DEFAULT_EFF_ISL_THRESHOLD = 2048
DEFAULT_EFF_ISL_RATIO_THRESHOLD = 0.7
_CONFIG_FIELDS = ("policy", "eff_isl_threshold", "eff_isl_ratio_threshold", "prefill_busy_threshold", "decode_busy_threshold")


@dataclass(frozen=True, slots=True)
class DisaggPolicyConfig:
    """``enabled`` False means unconditional disaggregation (every request goes remote)."""

    enabled: bool = False
    policy: str = POLICY_ISL_BOUNDING
    eff_isl_threshold: int = DEFAULT_EFF_ISL_THRESHOLD
    eff_isl_ratio_threshold: float = DEFAULT_EFF_ISL_RATIO_THRESHOLD
    prefill_busy_threshold: float | None = None  # None: inherit the router's queue threshold
    decode_busy_threshold: float | None = None  # None: guard off
    decode_fallback: bool = True  # prefill locally when there is no prefill worker or it failed

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"conditional disagg policy {self.policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        if self.eff_isl_threshold < 0:
            raise ConfigError(f"eff_isl_threshold must be >= 0, got {self.eff_isl_threshold}")
        if not 0.0 <= self.eff_isl_ratio_threshold <= 1.0:
            raise ConfigError(f"eff_isl_ratio_threshold must be in [0.0, 1.0], got {self.eff_isl_ratio_threshold}")
        for name in ("prefill_busy_threshold", "decode_busy_threshold"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")

    @property
    def name(self) -> str:
        """The policy in force, as decisions show it."""
        return self.policy if self.enabled else POLICY_ALWAYS


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregated serving")
    g.add_argument(
        "--router-conditional-disagg", action="store_true",
        help="prefill some requests locally on their decode worker (policy below) [default off: all remote]",
    )
    g.add_argument(
        "--router-conditional-disagg-config", default=None,
        help='JSON policy settings: {"policy": "isl_bounding|prefill_load|isl_or_load", "eff_isl_threshold": 2048, '
        '"eff_isl_ratio_threshold": 0.7, "prefill_busy_threshold": null, "decode_busy_threshold": null}',
    )
    g.add_argument(
        "--decode-fallback", action=argparse.BooleanOptionalAction, default=True,
        help="prefill on the decode worker when no prefill worker is there or prefill fails [default on]",
    )


def disagg_config_from_args(args: argparse.Namespace) -> DisaggPolicyConfig:
    raw = getattr(args, "router_conditional_disagg_config", None)
    fields: dict[str, object] = {}
    if raw:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--router-conditional-disagg-config is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ConfigError("--router-conditional-disagg-config must be a JSON object")
        unknown = sorted(set(parsed) - set(_CONFIG_FIELDS))
        if unknown:
            raise ConfigError(
                f"--router-conditional-disagg-config has unknown fields {unknown}; known: {', '.join(_CONFIG_FIELDS)}"
            )
        fields = parsed
    try:
        return DisaggPolicyConfig(
            enabled=bool(getattr(args, "router_conditional_disagg", False)),
            decode_fallback=bool(getattr(args, "decode_fallback", True)),
            **fields,  # type: ignore[arg-type]
        )
    except TypeError as exc:
        raise ConfigError(f"--router-conditional-disagg-config: {exc}") from None


@dataclass(frozen=True, slots=True)
class DisaggInputs:
    """The numbers one decision needs, gathered by the caller.

    ``decode_cached_tokens``: the prompt's prefix cached on the chosen decode worker.
    ``prefill_load``: the chosen prefill worker's load in the unit of ``prefill_busy_threshold``
    (None when there is no prefill worker). ``decode_kv_fraction``: the chosen decode worker's
    projected active KV blocks over its capacity (None when unknown)."""

    isl: int
    decode_cached_tokens: int = 0
    prefill_available: bool = True
    prefill_load: float | None = None
    prefill_busy_threshold: float | None = None  # the router's queue threshold, when the config has none
    decode_kv_fraction: float | None = None
    prefill_worker_id: int | None = None


def decide(config: DisaggPolicyConfig, inputs: DisaggInputs) -> DisaggInfo:
    """Remote or local prefill for one request, with the reason and the numbers behind it."""
    isl = inputs.isl
    eff = max(isl - inputs.decode_cached_tokens, 0)
    base = {"policy": config.name, "isl": isl, "effective_isl": eff}
    if not inputs.prefill_available:
        return DisaggInfo(mode=DISAGG_LOCAL, reason=REASON_NO_PREFILL_WORKERS, detail="no ready prefill worker", **base)
    remote = {"prefill_worker_id": inputs.prefill_worker_id, **base}
    if not config.enabled:
        return DisaggInfo(mode=DISAGG_REMOTE, reason=REASON_ALWAYS, detail="unconditional disaggregation", **remote)
    guard = config.decode_busy_threshold
    if guard is not None:
        frac = inputs.decode_kv_fraction
        if frac is None or frac > guard:
            shown = "unknown" if frac is None else f"{frac:.2f}"
            return DisaggInfo(
                mode=DISAGG_REMOTE, reason=REASON_DECODE_BUSY,
                detail=f"decode worker kv {shown} > decode_busy_threshold {guard:.2f}", **remote,
            )
    ratio = eff / isl if isl else 0.0
    isl_local = eff < config.eff_isl_threshold and ratio < config.eff_isl_ratio_threshold
    busy_at = config.prefill_busy_threshold if config.prefill_busy_threshold is not None else inputs.prefill_busy_threshold
    load = inputs.prefill_load
    load_local = busy_at is not None and load is not None and load > busy_at
    policy = config.policy
    if policy in (POLICY_ISL_BOUNDING, POLICY_ISL_OR_LOAD) and isl_local:
        return DisaggInfo(
            mode=DISAGG_LOCAL, reason=REASON_ISL_BOUNDING,
            detail=f"effective isl {eff} < {config.eff_isl_threshold} and ratio {ratio:.2f} < {config.eff_isl_ratio_threshold:.2f}",
            **base,
        )
    if policy in (POLICY_PREFILL_LOAD, POLICY_ISL_OR_LOAD) and load_local:
        return DisaggInfo(
            mode=DISAGG_LOCAL, reason=REASON_PREFILL_BUSY,
            detail=f"prefill worker load {load:.2f} > busy threshold {busy_at:.2f}", **base,
        )
    if policy == POLICY_PREFILL_LOAD:
        shown = "unset" if busy_at is None else f"{busy_at:.2f}"
        detail = f"prefill worker load {0.0 if load is None else load:.2f} <= busy threshold {shown}"
        return DisaggInfo(mode=DISAGG_REMOTE, reason=REASON_PREFILL_NOT_BUSY, detail=detail, **remote)
    return DisaggInfo(
        mode=DISAGG_REMOTE, reason=REASON_ISL_ABOVE,
        detail=f"effective isl {eff} (ratio {ratio:.2f}) not below {config.eff_isl_threshold} / {config.eff_isl_ratio_threshold:.2f}",
        **remote,
    )


def prefill_failed(info: DisaggInfo, error: str) -> DisaggInfo:
    """The same request, now prefilled locally because the remote prefill failed."""
    return DisaggInfo(
        mode=DISAGG_LOCAL, policy=info.policy, reason=REASON_PREFILL_FAILED, detail=error[:200],
        isl=info.isl, effective_isl=info.effective_isl, prefill_worker_id=info.prefill_worker_id,
    )
