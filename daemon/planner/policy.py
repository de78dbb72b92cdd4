"""The seam between the planner's policies (pure: observations in, replica counts out) and the
daemon that feeds them (event-plane load, frontend or Prometheus metrics, discovery counts) and
acts on what they return. The same policies run in the daemon and inside ``dynamod replay
--planner``, on the simulated clock: nothing here reads a clock, a socket or a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dynamod.shared.protocol.planner import ACTION_HOLD


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's last load report (``LoadMetrics`` on ``kv_metrics``), as the load planner uses it."""

    worker_id: int
    kv_usage: float  # 0..1
    num_waiting: int
    num_running: int
    active_prefill_tokens: int
    active_decode_blocks: int
    total_blocks: int


@dataclass(frozen=True, slots=True)
class TrafficSample:
    """What the frontends saw over the last interval (SLA planner input). ``None`` where nothing
    was measured (no requests finished in the interval)."""

    duration_s: float
    num_requests: float  # requests that arrived in the interval (finished + growth of in-flight)
    isl: float | None  # mean prompt tokens
    osl: float | None  # mean output tokens
    ttft_ms: float | None  # mean time to first token
    itl_ms: float | None  # mean inter-token latency


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """One pool at one interval: how many ready workers it has and their load."""

    pool: str  # POOL_*
    ready: int
    loads: tuple[WorkerLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Observation:
    now: float  # seconds, the caller's clock (wall or simulated)
    pools: dict[str, PoolObservation]
    traffic: TrafficSample | None = None  # SLA planner only


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """A policy's answer for one pool. ``desired`` is already clamped to the pool's budget."""

    pool: str
    desired: int
    action: str = ACTION_HOLD  # ACTION_*
    reason: str = ""
    detail: str = ""
    inputs: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)


class PlannerPolicy(Protocol):
    """``load`` or ``sla``. Called once per adjustment interval; keeps its own history (grace
    periods, predictor state) between calls."""

    name: str  # "load" | "sla"
    interval_s: float

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        """Desired replicas per pool of the observation. Never raises on odd input (no workers,
        no traffic): it holds and says why."""
        ...
