"""The ``dynamod up`` side of the local connector: add and remove worker processes on request.

The planner (its local connector) writes ``DesiredReplicas`` to the cluster's discovery; this
scaler watches that key and reconciles the supervisor's workers towards it, then answers with
``ScaledReplicas`` once discovery shows the new counts ready. While it runs it keeps a
``ScalerRecord`` under its own lease, which is how the local connector knows someone will act.

Reconciling has a pure half, ``plan_scaling`` (desired counts and the workers running now in, the
workers to start and to stop out; unit-tested), and the half that acts:

- scale-up starts new children with the next free index of their pool (``worker-3``), built by the
  same function as the first ones, so they get the same flags; the supervisor restarts them and
  judges crash loops like any other child.
- scale-down picks the least loaded worker (in-flight requests from its ``/health``; a worker
  that is not up yet counts as the least loaded, it serves nobody), newest first among equals. It
  is drained through its ``drain`` control endpoint (its status becomes ``draining``, so routers
  stop sending, and the call returns once its in-flight requests finished or ``drain_timeout_s``
  passed), then retired (SIGTERM, whose graceful path waits for stragglers too; not restarted).
  The drain intent the worker recorded under its name is cleared, or a later scale-up that
  reuses the name would start a worker that drains itself at once.

Requests are handled one at a time, the newest pending one next (a request that arrives during a
drain is not lost, the ones it replaced are skipped). A desired count is clamped to the pool's
budget (``--max-workers``; never below one serving worker), so a stray key cannot fork a host to
death. A ``DesiredReplicas`` left by an earlier run is deleted at start: it was meant for workers
that no longer exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from dynamod.daemon.supervisor.children import Child, ChildSpec, Supervisor
from dynamod.shared.cluster.drain import drain_instances
from dynamod.shared.cluster.pools import count_ready, pool_instances
from dynamod.shared.discovery.key_watch import watch_key
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.keys import (
    instances_prefix,
    planner_desired_key,
    planner_scaled_key,
    planner_scaler_key,
)
from dynamod.shared.protocol.planner import POOL_COMPONENT, DesiredReplicas, ScaledReplicas, ScalerRecord
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.instances import InstanceSet
from dynamod.shared.runtime.intent import clear_intent

logger = logging.getLogger(__name__)

SCALER_BY = "supervisor"
DEFAULT_DRAIN_TIMEOUT_S = 120.0
DEFAULT_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class PoolBudget:
    """The fewest and most workers the scaler runs in one pool, whatever it is asked."""

    min_workers: int
    max_workers: int

    def clamp(self, n: int) -> int:
        return max(self.min_workers, min(self.max_workers, n))


@dataclass(frozen=True, slots=True)
class RunningWorker:
    """A worker child as the reconciler sees it."""

    name: str
    pool: str
    index: int
    started_at: float  # monotonic; the newest is removed first among equally loaded ones
    inflight: int | None = None  # None: unknown (not answering yet), counts as the least loaded
    retiring: bool = False  # being stopped: not counted, but its index is still taken


@dataclass(slots=True)
class ScalePlan:
    targets: dict[str, int] = field(default_factory=dict)  # pool -> count after clamping
    add: dict[str, list[int]] = field(default_factory=dict)  # pool -> indices of the new workers
    remove: list[RunningWorker] = field(default_factory=list)
    clamped: dict[str, tuple[int, int]] = field(default_factory=dict)  # pool -> (asked, granted)
    ignored: list[str] = field(default_factory=list)  # pools asked for that this cluster does not run

    @property
    def empty(self) -> bool:
        return not self.remove and not any(self.add.values())


def _removal_order(w: RunningWorker) -> tuple[int, float]:
    return (-1 if w.inflight is None else w.inflight, -w.started_at)


def plan_scaling(
    desired: Mapping[str, int], running: Mapping[str, list[RunningWorker]], budget: Mapping[str, PoolBudget]
) -> ScalePlan:
    """What to start and stop so each pool of ``budget`` reaches ``desired`` (clamped); pools
    ``desired`` does not mention keep their size."""
    plan = ScalePlan()
    for pool in desired:
        if pool not in budget:
            plan.ignored.append(pool)
    for pool, limits in budget.items():
        workers = running.get(pool, [])
        live = [w for w in workers if not w.retiring]
        if pool not in desired:
            plan.targets[pool] = len(live)
            continue
        asked = desired[pool]
        target = limits.clamp(asked)
        if target != asked:
            plan.clamped[pool] = (asked, target)
        plan.targets[pool] = target
        if target > len(live):
            taken = {w.index for w in workers}
            indices: list[int] = []
            candidate = 0
            while len(indices) < target - len(live):
                if candidate not in taken:
                    indices.append(candidate)
                candidate += 1
            plan.add[pool] = indices
        elif target < len(live):
            plan.remove += sorted(live, key=_removal_order)[: len(live) - target]
    return plan


@dataclass(frozen=True)
class PoolTemplate:
    """How one pool's workers are named and started (``up.worker_spec`` with the role bound)."""

    pool: str
    prefix: str  # child names are f"{prefix}-{index}"
    spec: Callable[[int], ChildSpec]

    def child_name(self, index: int) -> str:
        return f"{self.prefix}-{index}"

    def index_of(self, name: str) -> int | None:
        head, sep, tail = name.rpartition("-")
        if sep and head == self.prefix and tail.isdigit():
            return int(tail)
        return None


def _inflight(health_url: str) -> int | None:
    try:
        with urllib.request.urlopen(health_url, timeout=2.0) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    value = body.get("inflight") if isinstance(body, dict) else None
    return int(value) if isinstance(value, int | float) else None


def _health_url(spec: ChildSpec) -> str | None:
    url = spec.live_url
    return url[: -len("/live")] + "/health" if url and url.endswith("/live") else None


class Scaler:
    """Reconciles the supervisor's worker children with the planner's ``DesiredReplicas``."""

    def __init__(
        self,
        supervisor: Supervisor,
        runtime: DistributedRuntime,
        templates: Mapping[str, PoolTemplate],
        budget: Mapping[str, PoolBudget],
        *,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        stop_grace_s: float = 30.0,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        self.supervisor = supervisor
        self.runtime = runtime
        self.store = runtime.store
        self.namespace = runtime.settings.namespace
        self.templates = dict(templates)
        self.budget = dict(budget)
        self.drain_timeout_s = drain_timeout_s
        self.stop_grace_s = stop_grace_s
        self.ready_timeout_s = ready_timeout_s
        self.instances = InstanceSet(self.store, instances_prefix(self.namespace))
        self.desired_key = planner_desired_key(self.namespace)
        self.scaled_key = planner_scaled_key(self.namespace)
        self.scaler_key = planner_scaler_key(self.namespace)
        self._latest: DesiredReplicas | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._retiring: set[str] = set()
        self.acted: list[ScaledReplicas] = []  # what it reported, oldest first (tests, the log)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Clears an earlier run's request and answer, then announces itself and starts watching."""
        await self.store.delete(self.desired_key)
        await self.store.delete(self.scaled_key)
        await self.instances.start()
        record = ScalerRecord(
            by=SCALER_BY, pid=os.getpid(), node=socket.gethostname(),
            max_replicas={p: b.max_workers for p, b in self.budget.items()}, ts=time.time(),
        )
        await self.store.put(self.scaler_key, msgspec.json.encode(record), lease=self.runtime.lease)
        self._tasks = [
            asyncio.create_task(self._watch_desired(), name="scaler-watch-desired"),
            asyncio.create_task(self._reconcile_loop(), name="scaler-reconcile"),
        ]
        logger.info("scaler started namespace=%s budget=%s", self.namespace,
                    {p: (b.min_workers, b.max_workers) for p, b in self.budget.items()})

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(DynamoError):
            await self.store.delete(self.scaler_key)
        await self.instances.close()

    # -- what runs now --------------------------------------------------------------------------

    def _pool_of_child(self, child: Child) -> tuple[str, int] | None:
        for pool, template in self.templates.items():
            index = template.index_of(child.spec.name)
            if index is not None:
                return pool, index
        return None

    async def running(self) -> dict[str, list[RunningWorker]]:
        """pool -> its worker children, with their in-flight counts (read in parallel)."""
        found: list[tuple[str, int, Child]] = []
        for child in list(self.supervisor.children):
            where = self._pool_of_child(child)
            if where is not None:
                found.append((where[0], where[1], child))
        loads = await asyncio.gather(*(self._child_inflight(c) for _, _, c in found))
        out: dict[str, list[RunningWorker]] = {pool: [] for pool in self.templates}
        for (pool, index, child), inflight in zip(found, loads, strict=True):
            out[pool].append(RunningWorker(
                child.spec.name, pool, index, child.started_at, inflight,
                # A worker given up on (crash loop) serves nobody: not counted, its name still taken.
                retiring=child.retiring or child.failed is not None or child.spec.name in self._retiring,
            ))
        return out

    async def _child_inflight(self, child: Child) -> int | None:
        url = _health_url(child.spec)
        return None if url is None or child.pid is None else await asyncio.to_thread(_inflight, url)

    def ready_counts(self) -> dict[str, int]:
        counts = count_ready(self.instances.instances)
        return {pool: counts.get(pool, 0) for pool in self.templates}

    # -- the loop -------------------------------------------------------------------------------

    async def _watch_desired(self) -> None:
        async for desired in watch_key(self.store, self.desired_key, DesiredReplicas):
            self._latest = desired
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        done: DesiredReplicas | None = None
        while True:
            await self._wake.wait()
            self._wake.clear()
            desired = self._latest
            if desired is None or desired == done:
                continue
            try:
                await self.reconcile(desired)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one failed request must not end scaling for the cluster's life
                logger.exception("scaling failed decision_id=%d error=%s", desired.decision_id, exc)
                with contextlib.suppress(DynamoError):  # discovery down: the planner's ack timeout tells
                    await self._report(desired.decision_id, f"scaling failed: {exc}")
            done = desired

    async def reconcile(self, desired: DesiredReplicas) -> ScaledReplicas:
        """Starts and stops workers towards ``desired``, waits for discovery to show the counts
        ready, and writes ``ScaledReplicas``."""
        plan = plan_scaling(desired.replicas, await self.running(), self.budget)
        if plan.ignored:
            logger.warning("scaling asked for pools this cluster does not run pools=%s", plan.ignored)
        for pool, (asked, granted) in plan.clamped.items():
            logger.warning("scaling clamped to the budget pool=%s asked=%d granted=%d", pool, asked, granted)
        logger.info(
            "scaling decision_id=%d targets=%s add=%s remove=%s",
            desired.decision_id, plan.targets, plan.add, [w.name for w in plan.remove],
        )
        for pool, indices in plan.add.items():
            for index in indices:
                await self._add(pool, index)
        if plan.remove:
            await asyncio.gather(*(self._remove(w) for w in plan.remove))
        reached = await self._until_ready(plan.targets)
        error = ""
        if reached != plan.targets:
            error = f"ready workers {reached} did not reach {plan.targets} within {self.ready_timeout_s:g}s"
            logger.warning("scaling incomplete decision_id=%d %s", desired.decision_id, error)
        return await self._report(desired.decision_id, error, reached)

    async def _add(self, pool: str, index: int) -> None:
        template = self.templates[pool]
        spec = template.spec(index)
        # An operator's drain or sleep recorded under this name belonged to a worker that is gone.
        await clear_intent(self.store, self.namespace, POOL_COMPONENT[pool], spec.name)
        child = await self.supervisor.add_child(spec)
        logger.info("worker added pool=%s name=%s pid=%s", pool, spec.name, child.pid)

    async def _remove(self, worker: RunningWorker) -> None:
        self._retiring.add(worker.name)
        try:
            drained = await self._drain(worker)
            code = await self.supervisor.retire(worker.name, self.stop_grace_s)
            await clear_intent(self.store, self.namespace, POOL_COMPONENT[worker.pool], worker.name)
            logger.info("worker removed pool=%s name=%s drained=%s code=%s", worker.pool, worker.name, drained, code)
        finally:
            self._retiring.discard(worker.name)

    async def _drain(self, worker: RunningWorker) -> bool:
        """Drains ``worker`` through its control endpoint; False when it could not be (not
        registered yet, or timed out): SIGTERM's graceful path still lets in-flight work finish."""
        try:
            child = self.supervisor.child(worker.name)
        except KeyError:
            return False
        pid = child.pid
        ids = sorted({
            i.instance_id for i in pool_instances(self.instances.instances)[worker.pool]
            if i.pid == pid or i.labels.get("worker_name") == worker.name
        })
        if pid is None or not ids:
            return False
        return await drain_instances(self.runtime, self.namespace, POOL_COMPONENT[worker.pool], ids, self.drain_timeout_s)

    async def _until_ready(self, targets: dict[str, int]) -> dict[str, int]:
        """The ready counts once they equal ``targets`` (or when ``ready_timeout_s`` passed)."""
        try:
            await self.instances.wait_for(lambda _insts: self.ready_counts() == targets, self.ready_timeout_s)
        except TimeoutError:
            pass
        return self.ready_counts()

    async def _report(self, decision_id: int, error: str = "", reached: dict[str, int] | None = None) -> ScaledReplicas:
        scaled = ScaledReplicas(
            decision_id=decision_id, replicas=reached if reached is not None else self.ready_counts(),
            ts=time.time(), by=SCALER_BY, error=error,
        )
        await self.store.put(self.scaled_key, msgspec.json.encode(scaled))
        self.acted.append(scaled)
        logger.info("scaled decision_id=%d replicas=%s error=%s", decision_id, scaled.replicas, error or "-")
        return scaled
