"""Conditional disaggregation: prefill a request on the prefill pool, or locally on its decode worker.

``--router-conditional-disagg`` turns it on; ``--router-conditional-disagg-config`` is a JSON object
with the fields of ``DisaggPolicyConfig``. Policies:

- ``cost`` (the default): predicted time to first token both ways (daemon/router/core/disagg_cost.py).
  Local: the prompt tokens the chosen decode worker does not cache, after the prefill work queued
  there, plus the decode step each chunk carries while decodes run there, plus the stall those
  decodes see (``interference_weight`` times the prompt's compute). Remote: the chosen prefill
  worker's queue and the tokens it does not cache, the transfer of the blocks the decode worker
  lacks (bytes over the measured bandwidth, else ``transfer_bandwidth_gb_s``, plus
  ``transfer_latency_ms``), the decode worker's first step. Live, each side also carries what that
  path has measurably cost beyond its prediction for prompts of this size (``PathOverhead``).
  The lower wins; ties go local. Compute times come from the mocker's timing model in replay and
  from a performance profile live (``perf_profile``, default the shipped mocker one).
- Dynamo's three, kept as options:

  - ``isl_bounding``: local when the effective input length (prompt tokens minus the prefix the
    chosen *decode* worker already caches) is below ``eff_isl_threshold`` (2048) and either the
    whole prompt is shorter than that threshold or the effective over raw ratio is below
    ``eff_isl_ratio_threshold`` (0.7). Dynamo 1.6 requires the ratio test of every prompt, which
    sends every fresh prompt remote however short (ratio 1.0): a 16-token prompt paid for a
    remote prefill. Here the ratio only guards prompts at least ``eff_isl_threshold`` long, which
    is what it is for: a long prompt stays local only when most of it is cached.
  - ``prefill_load``: local when the chosen prefill worker is above ``prefill_busy_threshold``.
  - ``isl_or_load``: local when either holds.

- ``decode_busy_threshold`` (off by default) guards all of them: when the chosen decode worker's
  projected active KV blocks exceed this fraction of its capacity, prefill stays remote.

Without the flag every request with a prefill pool goes remote (``always``). With no prefill
worker the request is prefilled locally (``no_prefill_workers``) unless ``--decode-fallback`` is off.
The decision is pure: callers gather the numbers (routers, replay) and record the ``DisaggInfo``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from functools import lru_cache

from dynamod.daemon.perf.mocker_timing import DEFAULT_KV_BYTES_PER_TOKEN
from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.router.core.disagg_cost import (
    DEFAULT_INTERFERENCE_WEIGHT,
    DEFAULT_TRANSFER_BANDWIDTH_GB_S,
    DEFAULT_TRANSFER_LATENCY_MS,
    OVERLAP_CHUNK,
    OVERLAP_NONE,
    OVERLAPS,
    ComputeModel,
    CostState,
    ProfileCompute,
    TransferEstimate,
    predict,
)
from dynamod.daemon.router.core.local_choice import LocalPrefillChoice
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.routing import DISAGG_LOCAL, DISAGG_REMOTE, DisaggInfo

POLICY_ALWAYS = "always"
POLICY_COST = "cost"
POLICY_ISL_BOUNDING = "isl_bounding"
POLICY_PREFILL_LOAD = "prefill_load"
POLICY_ISL_OR_LOAD = "isl_or_load"
POLICIES = (POLICY_COST, POLICY_ISL_BOUNDING, POLICY_PREFILL_LOAD, POLICY_ISL_OR_LOAD)

REASON_ALWAYS = "always"
REASON_NO_PREFILL_WORKERS = "no_prefill_workers"
REASON_ISL_BOUNDING = "isl_bounding"
REASON_PREFILL_BUSY = "prefill_busy"
REASON_PREFILL_NOT_BUSY = "prefill_not_busy"
REASON_DECODE_BUSY = "decode_busy"
REASON_ISL_ABOVE = "isl_above_threshold"
REASON_PREFILL_FAILED = "prefill_failed"
REASON_COST_LOCAL = "cost_local"
REASON_COST_REMOTE = "cost_remote"

DEFAULT_EFF_ISL_THRESHOLD = 2048
DEFAULT_EFF_ISL_RATIO_THRESHOLD = 0.7
_CONFIG_FIELDS = (
    "policy", "eff_isl_threshold", "eff_isl_ratio_threshold", "prefill_busy_threshold", "decode_busy_threshold",
    "interference_weight", "kv_bytes_per_token", "transfer_bandwidth_gb_s", "transfer_latency_ms", "perf_profile",
    "remote_decode_overlap_weight",
)


@dataclass(frozen=True, slots=True)
class DisaggPolicyConfig:
    """``enabled`` False means unconditional disaggregation (every request goes remote)."""

    enabled: bool = False
    policy: str = POLICY_COST
    eff_isl_threshold: int = DEFAULT_EFF_ISL_THRESHOLD
    eff_isl_ratio_threshold: float = DEFAULT_EFF_ISL_RATIO_THRESHOLD
    prefill_busy_threshold: float | None = None  # None: inherit the router's queue threshold
    decode_busy_threshold: float | None = None  # None: guard off
    decode_fallback: bool = True  # prefill locally when there is no prefill worker or it failed
    # ``cost`` policy: the weight of the stall a local prefill puts on the decodes running there,
    # the KV bytes one token moves, the configured transfer bandwidth (GB/s, 10^9 bytes; a
    # measured one replaces it live) and per-transfer latency, and the performance profile live
    # compute times come from (None: the shipped mocker profile).
    interference_weight: float = DEFAULT_INTERFERENCE_WEIGHT
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    transfer_bandwidth_gb_s: float = DEFAULT_TRANSFER_BANDWIDTH_GB_S
    transfer_latency_ms: float = DEFAULT_TRANSFER_LATENCY_MS
    perf_profile: str | None = None
    # The decode stage of a remotely prefilled prompt: how much a decode worker's cached prefix
    # counts in its choice (the KV router's overlap weight). A cached block there is one the
    # transfer does not move, so it keeps its credit (None: the router's configured weight); 0 is
    # Dynamo's decode router, which routes remote prompts with no cache credit.
    remote_decode_overlap_weight: float | None = None
    # When the prompt's KV moves to the decode worker (``disagg_cost.OVERLAPS``): live, what the
    # prefill workers' ``--kv-transfer-overlap`` does (``--kv-transfer-overlap`` here says so).
    transfer_overlap: str = OVERLAP_NONE

    def __post_init__(self) -> None:
        if self.transfer_overlap not in OVERLAPS:
            raise ConfigError(f"transfer_overlap must be one of {', '.join(OVERLAPS)}, got {self.transfer_overlap!r}")
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
        if not self.interference_weight >= 0:
            raise ConfigError(f"interference_weight must be >= 0, got {self.interference_weight}")
        if self.kv_bytes_per_token < 1:
            raise ConfigError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if not self.transfer_bandwidth_gb_s > 0:
            raise ConfigError(f"transfer_bandwidth_gb_s must be > 0, got {self.transfer_bandwidth_gb_s}")
        if self.remote_decode_overlap_weight is not None and not self.remote_decode_overlap_weight >= 0:
            raise ConfigError(f"remote_decode_overlap_weight must be >= 0 or null, got {self.remote_decode_overlap_weight}")
        if not self.transfer_latency_ms >= 0:
            raise ConfigError(f"transfer_latency_ms must be >= 0, got {self.transfer_latency_ms}")

    @property
    def name(self) -> str:
        """The policy in force, as decisions show it."""
        return self.policy if self.enabled else POLICY_ALWAYS

    def local_prefill_choice(self, compute: ComputeModel | None = None) -> LocalPrefillChoice | None:
        """How the decode stage of a prompt kept local picks its worker (local_choice.py: by the
        predicted time of its prefill there, with ``compute``, None: ``profile_compute()``); None
        when the policy is off (every prompt remote, a fallback is rare). Live routing (frontend,
        router role) and replay take it from here, for the decode stage of a local prompt only."""
        if not self.enabled:
            return None
        return LocalPrefillChoice(compute if compute is not None else self.profile_compute(), self.interference_weight)

    def decode_overlap_weight(self, remote: bool) -> float | None:
        """The overlap weight the decode stage is routed with (None: the router's configured
        one): the one place live routing (frontend, router role) and replay take it from."""
        return self.remote_decode_overlap_weight if remote else None

    @property
    def transfer(self) -> TransferEstimate:
        """The configured transfer estimate (live callers swap in a measured bandwidth)."""
        return TransferEstimate(
            self.kv_bytes_per_token, self.transfer_bandwidth_gb_s, self.transfer_latency_ms, overlap=self.transfer_overlap
        )

    def profile_compute(self) -> ProfileCompute:
        """The live compute model: ``perf_profile``, or the shipped mocker profile. Loaded once
        per path; a bad file is a ``ProfileError`` (a ``ConfigError``) at start-up."""
        return _profile_compute(self.perf_profile or default_profile_path())


@lru_cache(maxsize=8)
def _profile_compute(path: str) -> ProfileCompute:
    return ProfileCompute(PerfProfile.load(path), name=f"profile:{path.rsplit('/', 1)[-1]}")


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregated serving")
    g.add_argument(
        "--router-conditional-disagg", action="store_true",
        help="prefill some requests locally on their decode worker (policy below) [default off: all remote]",
    )
    g.add_argument(
        "--router-conditional-disagg-config", default=None,
        help='JSON policy settings: {"policy": "cost|isl_bounding|prefill_load|isl_or_load" (default cost), '
        '"eff_isl_threshold": 2048, "eff_isl_ratio_threshold": 0.7, "prefill_busy_threshold": null, '
        '"decode_busy_threshold": null, "interference_weight": 1.0, "kv_bytes_per_token": 131072, '
        '"transfer_bandwidth_gb_s": 25.0, "transfer_latency_ms": 1.0, "perf_profile": null, '
        '"remote_decode_overlap_weight": null}',
    )
    if not any("--kv-transfer-overlap" in a.option_strings for a in parser._actions):  # replay has its own
        g.add_argument(
            "--kv-transfer-overlap", choices=(OVERLAP_CHUNK, OVERLAP_NONE),
            default=os.environ.get("DYN_KV_TRANSFER_OVERLAP", OVERLAP_CHUNK),
            help="what the prefill workers' --kv-transfer-overlap does, for the cost policy's transfer estimate: "
            "chunk, only the part of the transfer after the prefill's last chunk delays the first token; none, "
            "all of it [env DYN_KV_TRANSFER_OVERLAP, default %(default)s]",
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
            transfer_overlap=getattr(args, "kv_transfer_overlap", OVERLAP_NONE),
            **fields,  # type: ignore[arg-type]
        )
    except TypeError as exc:
        raise ConfigError(f"--router-conditional-disagg-config: {exc}") from None


@dataclass(frozen=True, slots=True)
class DisaggInputs:
    """The numbers one decision needs, gathered by the caller.

    ``decode_cached_tokens``: the prompt's prefix cached on the chosen decode worker.
    ``prefill_load``: the chosen prefill worker's load in the unit of ``prefill_busy_threshold``
    (queued prefill tokens; None when there is no prefill worker). ``decode_kv_fraction``: the
    chosen decode worker's projected active KV blocks over its capacity (None when unknown).
    The ``cost`` policy also reads the decode worker's queued prefill tokens and running decodes,
    the prefix cached on the prefill worker, the transfer estimate (None: the config's) and each
    path's measured extra cost (``disagg_cost.PathOverhead``)."""

    isl: int
    decode_cached_tokens: int = 0
    prefill_available: bool = True
    prefill_load: float | None = None
    prefill_busy_threshold: float | None = None  # the router's queue threshold, when the config has none
    decode_kv_fraction: float | None = None
    prefill_worker_id: int | None = None
    decode_worker_id: int | None = None
    decode_queued_tokens: int = 0
    running_decodes: int = 0
    prefill_cached_tokens: int = 0
    transfer: TransferEstimate | None = None
    local_overhead_ms: float = 0.0
    remote_overhead_ms: float = 0.0
    # The path is unmeasured at this prompt size and enough requests already went that way to
    # measure it (``PathOverhead.may_explore``): the cost policy takes the other one.
    local_measuring: bool = False
    remote_measuring: bool = False
    # The remote path's overhead at this prompt size is measured (``PathOverhead.measured``): only
    # then does a local path still being measured hand its prompts to it.
    remote_measured: bool = False


def decide(config: DisaggPolicyConfig, inputs: DisaggInputs, compute: ComputeModel | None = None) -> DisaggInfo:
    """Remote or local prefill for one request, with the reason and the numbers behind it.
    ``compute``: the ``cost`` policy's compute model (None: ``config.profile_compute()``)."""
    isl = inputs.isl
    eff = max(isl - inputs.decode_cached_tokens, 0)
    base = {"policy": config.name, "isl": isl, "effective_isl": eff, "decode_worker_id": inputs.decode_worker_id}
    if not inputs.prefill_available:
        return DisaggInfo(mode=DISAGG_LOCAL, reason=REASON_NO_PREFILL_WORKERS, detail="no ready prefill worker", **base)
    base["prefill_worker_id"] = inputs.prefill_worker_id
    remote = base
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
    policy = config.policy
    if policy == POLICY_COST:
        return _decide_cost(config, inputs, compute or config.profile_compute(), base)
    threshold = config.eff_isl_threshold
    ratio = eff / isl if isl else 0.0
    # The ratio guards long prompts only (see the module docstring): a prompt shorter than the
    # threshold is short whatever its cache hit.
    isl_local = eff < threshold and (isl < threshold or ratio < config.eff_isl_ratio_threshold)
    busy_at = config.prefill_busy_threshold if config.prefill_busy_threshold is not None else inputs.prefill_busy_threshold
    load = inputs.prefill_load
    load_local = busy_at is not None and load is not None and load > busy_at
    if policy in (POLICY_ISL_BOUNDING, POLICY_ISL_OR_LOAD) and isl_local:
        why = f"prompt {isl} < {threshold}" if isl < threshold else f"ratio {ratio:.2f} < {config.eff_isl_ratio_threshold:.2f}"
        return DisaggInfo(
            mode=DISAGG_LOCAL, reason=REASON_ISL_BOUNDING, detail=f"effective isl {eff} < {threshold} and {why}", **base,
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
    if eff >= threshold:
        detail = f"effective isl {eff} not below {threshold}"
    else:
        detail = f"effective isl {eff} < {threshold} but prompt {isl} >= {threshold} and ratio {ratio:.2f} not below {config.eff_isl_ratio_threshold:.2f}"
    return DisaggInfo(mode=DISAGG_REMOTE, reason=REASON_ISL_ABOVE, detail=detail, **remote)


def _decide_cost(config: DisaggPolicyConfig, inputs: DisaggInputs, compute: ComputeModel, base: dict) -> DisaggInfo:
    state = CostState(
        isl=inputs.isl,
        decode_cached_tokens=inputs.decode_cached_tokens,
        decode_queued_tokens=inputs.decode_queued_tokens,
        running_decodes=inputs.running_decodes,
        decode_kv_fraction=inputs.decode_kv_fraction or 0.0,
        prefill_cached_tokens=inputs.prefill_cached_tokens,
        prefill_queued_tokens=int(inputs.prefill_load or 0),
        local_overhead_ms=inputs.local_overhead_ms,
        remote_overhead_ms=inputs.remote_overhead_ms,
    )
    cost = predict(state, compute, inputs.transfer or config.transfer, config.interference_weight)
    local = cost.local_cost_ms <= cost.remote_cost_ms
    op = "<=" if local else ">"
    detail = (
        f"local {cost.local_cost_ms:.1f} ms (ttft {cost.local_ttft_ms:.1f} + interference {cost.local_interference_ms:.1f} "
        f"x {config.interference_weight:g}) {op} remote {cost.remote_cost_ms:.1f} ms"
    )
    # The cheaper path still being measured at this size: the other one meanwhile; both: local
    # (as a tie: a local prefill moves nothing). The local path hands its prompts over only to a
    # measured remote path: an unmeasured one is priced without its overhead, so a burst diverted
    # there (two dozen streams starting together) waited 62-68 ms where local took 56, on a
    # remote path predicted 70% dearer before any overhead; it is tried when it predicts cheaper.
    if inputs.remote_measuring and not local:
        local = True
        detail += "; remote path at this prompt size still being measured"
    elif inputs.local_measuring and local and inputs.remote_measured:
        local = False
        detail += "; local path at this prompt size still being measured"
    return DisaggInfo(
        mode=DISAGG_LOCAL if local else DISAGG_REMOTE,
        reason=REASON_COST_LOCAL if local else REASON_COST_REMOTE,
        detail=detail,
        prefill_cached_tokens=inputs.prefill_cached_tokens,
        cost=cost,
        **base,
    )


def prefill_failed(info: DisaggInfo, error: str) -> DisaggInfo:
    """The same request, now prefilled locally because the remote prefill failed."""
    return DisaggInfo(
        mode=DISAGG_LOCAL, policy=info.policy, reason=REASON_PREFILL_FAILED, detail=error[:200],
        isl=info.isl, effective_isl=info.effective_isl, prefill_worker_id=info.prefill_worker_id,
        decode_worker_id=info.decode_worker_id, prefill_cached_tokens=info.prefill_cached_tokens, cost=info.cost,
    )
