"""The planner's wire types: its decisions on the event plane, its status, the desired replica
counts it hands to an orchestrator, and the operator's manual overrides in discovery.

Pools: a pool is one kind of worker in one namespace, named by what it does, not by its component
(``prefill`` -> component ``prefill``; ``decode`` and ``agg`` -> component ``backend`` with that
role). A planner sizes ``prefill`` and ``decode`` in a disaggregated deployment, or ``agg`` alone.

Where each lives (keys in ``keys.py``):
- ``PlannerDecision``: published on the ``planner_decisions`` topic of ``{ns}/planner`` (msgpack)
  every interval for every pool, ``hold`` included, so a reader sees the inputs that kept the size.
- ``PlannerStatus``: ``v1/planner/{ns}/status`` (JSON) under the planner's lease: what it plans for
  now; gone when the planner is.
- ``DesiredReplicas`` / ``ScaledReplicas``: ``v1/planner/{ns}/desired`` and ``.../scaled`` (JSON, no
  lease). The planner's virtual and local connectors write the first; whoever carries it out (the
  ``dynamod up`` supervisor, an external orchestrator) writes the second with the decision id it
  acted on and the counts it reached.
- ``ScalerRecord``: ``v1/planner/{ns}/scaler`` (JSON) under the lease of the process that carries
  ``desired`` out on one host (the ``dynamod up`` supervisor); the local connector waits for it.
- ``ScaleOverride``: ``v1/planner/{ns}/override/{pool}`` (JSON, no lease): ``dynamoctl scale POOL N``.
  The planner keeps the pool at N (clamped to nothing: the operator wins) until the key is deleted.
"""

from __future__ import annotations

import msgspec

POOL_PREFILL = "prefill"
POOL_DECODE = "decode"
POOL_AGG = "agg"
POOLS = (POOL_PREFILL, POOL_DECODE, POOL_AGG)

# pool -> (component, worker role)
POOL_COMPONENT = {POOL_PREFILL: "prefill", POOL_DECODE: "backend", POOL_AGG: "backend"}
POOL_ROLE = {POOL_PREFILL: "prefill", POOL_DECODE: "decode", POOL_AGG: "agg"}
ROLE_POOL = {role: pool for pool, role in POOL_ROLE.items()}


def pool_of_role(role: str) -> str | None:
    """The pool of a worker whose instance record has ``role`` (None: not a worker role). The role,
    not the component, decides: decode and agg workers share the ``backend`` component."""
    return ROLE_POOL.get(role)

PLANNER_COMPONENT = "planner"

ACTION_SCALE_UP = "scale_up"
ACTION_SCALE_DOWN = "scale_down"
ACTION_HOLD = "hold"


class PlannerDecision(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One pool's decision at one interval, with what it was decided from.

    ``reason`` is a short snake_case word (``kv_usage_high``, ``queue_low``, ``sla_throughput``,
    ``grace_period``, ``at_max_budget``, ``override``, ``cold_start``, ``ttft_miss``,
    ``itl_miss``, ``itl_miss_prefill_interference``, ``queue_backlog``, ``capacity``,
    ``release_window``, ``scale_up_in_progress``, ``scale_up_settling``, ...); ``detail`` says the
    same in words with the numbers. ``inputs`` are the observed figures (``kv_usage``,
    ``num_waiting``, ``ttft_ms``, ``itl_ms``, ``request_rate``, ``isl``, ``osl``,
    ``ttft_over_frac``, ``itl_over_frac``, ``backlog_tokens``, ...) and the capacity model's numbers
    (``prefill_thpt``, ``decode_thpt``, ``prefill_cap``, ``prefill_load``, ``learned_factor``,
    ``need``, ``window_need``, ``predicted_floor``, ...), ``predicted`` the next interval's
    (``request_rate``, ``isl``, ``osl``), ``targets`` the SLA (``ttft_ms``, ``itl_ms``).
    """

    decision_id: int  # increases by one per interval, per planner (all pools of one interval share it)
    ts: float  # unix time
    namespace: str
    planner: str  # "load" | "sla"
    pool: str  # POOL_*
    component: str
    current: int  # ready replicas counted when deciding
    desired: int  # what the planner asks for (after clamping and overrides)
    action: str  # ACTION_*
    reason: str
    detail: str = ""
    inputs: dict[str, float] = {}
    predicted: dict[str, float] = {}
    targets: dict[str, float] = {}
    min_replicas: int = 0
    max_replicas: int = 0
    override: int | None = None  # the operator's manual count, when one is in force
    dry_run: bool = False
    connector: str = ""
    acted: bool = False  # the connector was asked to carry it out (False when dry-run or hold)
    error: str = ""  # the connector failed: why


class PoolStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    component: str
    current: int = 0
    desired: int = 0
    min_replicas: int = 0
    max_replicas: int = 0
    override: int | None = None
    # The pool's workers at the last decision (their ``kv_metrics`` reports): ``waiting`` and
    # ``running`` requests summed, ``kv_usage`` the fullest worker's share (0..1). What the
    # console's Scaling plot and ``dynamoctl planner status`` show as the pool's load.
    load: dict[str, float] = {}
    action: str = ""  # the last decision's ACTION_* and reason, for readers of discovery alone
    reason: str = ""


class PlannerStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    namespace: str
    planner: str  # "load" | "sla"
    connector: str
    interval_s: float
    dry_run: bool = False
    targets: dict[str, float] = {}  # ttft_ms, itl_ms (SLA planner)
    pools: dict[str, PoolStatus] = {}
    predicted: dict[str, float] = {}
    last_decision_id: int = 0
    ts: float = 0.0
    instance_id: int = 0  # the planner process's instance id
    # The traffic the planner measured over its last interval (its frontend or Prometheus
    # source, either planner): ``request_rate`` (arrivals/s), ``isl``, ``osl`` (mean tokens),
    # ``ttft_ms``, ``itl_ms`` (means); a figure nothing measured is absent. One reading that the
    # console and ``dynamoctl`` both show, so they never disagree.
    observed: dict[str, float] = {}


class DesiredReplicas(msgspec.Struct, kw_only=True, omit_defaults=True):
    replicas: dict[str, int]  # pool -> count
    decision_id: int
    ts: float = 0.0
    planner: str = ""


class ScaledReplicas(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Written by whoever carried out a ``DesiredReplicas``: the decision it acted on, and the
    counts of ready workers it reached (or is at when it gave up, with ``error``)."""

    decision_id: int
    replicas: dict[str, int]
    ts: float = 0.0
    by: str = ""  # "supervisor", the orchestrator's name
    error: str = ""


class ScalerRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``v1/planner/{ns}/scaler`` under the scaler's lease: a process that watches ``desired`` for
    this namespace and will act on it (the ``dynamod up`` supervisor). Gone when that process is,
    so the local connector can tell "nobody will act" from "not acted yet"."""

    by: str  # "supervisor"
    pid: int = 0
    node: str = ""
    max_replicas: dict[str, int] = {}  # pool -> the most workers it will run
    ts: float = 0.0


class ScaleOverride(msgspec.Struct, kw_only=True, omit_defaults=True):
    replicas: int
    set_by: str = ""  # user@host, or the tool
    ts: float = 0.0
    reason: str = ""


decision_encoder = msgspec.msgpack.Encoder()
decision_decoder = msgspec.msgpack.Decoder(PlannerDecision)
