"""What the replay's planner loop sees of the simulated fleet, and the lifecycle of a simulated core.

The simulator (simulator.py) owns the pools and the clock; the planner loop (planner_loop.py)
observes them and launches, drains and stops cores. Both import this module and neither imports
the other's internals: the simulator's pool and simulation satisfy these protocols structurally.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dynamod.daemon.engines.mocker.core import MockerCore
    from dynamod.daemon.replay.report import RequestStats

# A simulated core's lifecycle (a static replay keeps every core READY from 0 ms).
STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"


class SimulatedPool(Protocol):
    """One pool of simulated cores as the planner loop reads it."""

    name: str
    cores: list[MockerCore]
    state: list[str]  # each core's lifecycle state
    launched_ms: list[float]  # when each core was launched
    stopped_ms: list[float]  # when each core stopped (-1: running)
    inflight_prefill: list[int]  # prompt tokens each core is computing in its current step

    def ids(self, state: str) -> list[int]: ...

    def worker_seconds(self, end_ms: float) -> float: ...


class SimulatedFleet(Protocol):
    """The simulation as the planner loop drives it: its clock, pools, requests and core lifecycle."""

    now: float  # ms
    policy: Any  # the planner policy in the loop, or None for a static replay
    decode: SimulatedPool  # the decode pool (the only pool when aggregated)
    prefill: SimulatedPool
    stats: Mapping[str, RequestStats]

    @property
    def open_requests(self) -> int: ...

    def launch_core(self, pool: Any, startup_ms: float) -> int: ...

    def drain_core(self, pool: Any, w: int) -> None: ...
