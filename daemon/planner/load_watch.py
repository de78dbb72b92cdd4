"""The pools as the planner sees them: ready workers per pool from discovery, and each worker's
last load report from the event plane.

A pool is one kind of worker (``prefill``, ``decode``, ``agg``); its workers are the instances of
the pool's component serving ``generate``, and a ``backend`` instance belongs to ``decode`` or
``agg`` by the ``role`` of its record. Only ready instances count (a draining or sleeping worker is
capacity already leaving), and only their load reports: a report of a worker that left discovery
is dropped when it leaves, so a dead worker's last (often high) load never keeps a pool large.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from dynamod.daemon.planner.policy import PoolObservation, WorkerLoad
from dynamod.shared.events.plane import TOPIC_KV_METRICS, EventSubscriber
from dynamod.shared.protocol.instance import STATUS_DRAINING, Instance
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.protocol.load import LoadMetrics, load_decoder
from dynamod.shared.protocol.planner import POOL_AGG, POOL_PREFILL, POOLS, pool_of_role
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.instances import InstanceSet

logger = logging.getLogger(__name__)

GENERATE = "generate"
# A report from a worker discovery does not (yet) list is kept this long, so a report that races
# ahead of the instance record still counts once it lands, and one from a departed worker that
# arrived after its DELETE does not stay for ever.
UNLISTED_REPORT_TTL_S = 30.0


def pool_of(instance: Instance, prefill_component: str) -> str:
    """The pool an instance of a worker component belongs to: by its role, and for a record
    without a worker role by its component (the components may be renamed by flag)."""
    pool = pool_of_role(instance.role)
    if pool is not None:
        return pool
    return POOL_PREFILL if instance.component == prefill_component else POOL_AGG


class LoadWatch:
    """Follows the ``generate`` instances of the worker components and their ``kv_metrics``."""

    def __init__(self, runtime: DistributedRuntime, *, worker_component: str = "backend",
                 prefill_component: str = "prefill") -> None:
        self._rt = runtime
        self._ns = runtime.settings.namespace
        self._components = [c for c in dict.fromkeys((prefill_component, worker_component)) if c]
        self._prefill_component = prefill_component
        self._sets: list[InstanceSet] = []
        self._subs: list[EventSubscriber] = []
        self._tasks: list[asyncio.Task[None]] = []
        # (worker_id, dp_rank) -> (report, monotonic receive time)
        self._reports: dict[tuple[int, int], tuple[LoadMetrics, float]] = {}
        # instance id -> when it was first seen ready (monotonic): a worker's first interval is
        # cold, and the policies leave it out of capacity and scale-down evidence.
        self._ready_since: dict[int, float] = {}

    async def start(self) -> None:
        for component in self._components:
            # Subscribe before listing so no report of a listed worker is missed.
            sub = await self._rt.namespace().component(component).subscribe(TOPIC_KV_METRICS)
            self._subs.append(sub)
            self._tasks.append(asyncio.create_task(self._consume(sub), name=f"planner-load:{component}"))
            instances = InstanceSet(self._rt.store, instances_prefix(self._ns, component, GENERATE))
            instances.add_listener(self._on_instance)
            await instances.start()
            self._sets.append(instances)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.close()
        for instances in self._sets:
            await instances.close()
        self._tasks, self._subs, self._sets = [], [], []

    def _on_instance(self, _key: str, instance: Instance | None) -> None:
        if instance is not None:
            return
        live = {i.instance_id for s in self._sets for i in s.instances}
        for key in [k for k in self._reports if k[0] not in live]:
            del self._reports[key]

    async def _consume(self, sub: EventSubscriber) -> None:
        async for msg in sub:
            try:
                report = load_decoder.decode(msg.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring malformed load report error=%s", exc)
                continue
            self.observe(report)

    def observe(self, report: LoadMetrics, now: float | None = None) -> None:
        """Keeps ``report`` as its worker's (and data-parallel rank's) last."""
        self._reports[(report.worker_id, report.dp_rank)] = (report, time.monotonic() if now is None else now)

    def ready_instances(self) -> dict[str, list[Instance]]:
        pools: dict[str, list[Instance]] = {pool: [] for pool in POOLS}
        for s in self._sets:
            for inst in s.instances:
                if inst.routable:
                    pools[pool_of(inst, self._prefill_component)].append(inst)
        return pools

    def draining_counts(self) -> dict[str, int]:
        """Per pool, workers still listed but taking no new work (draining): paid for until they
        stop, so the GPU budget counts them."""
        counts = {pool: 0 for pool in POOLS}
        for s in self._sets:
            for inst in s.instances:
                if inst.status == STATUS_DRAINING:
                    counts[pool_of(inst, self._prefill_component)] += 1
        return counts

    def pools(self, now: float | None = None) -> dict[str, PoolObservation]:
        """Every pool (empty ones too, so a policy can see a pool at zero) with its ready workers
        and their last load reports."""
        now = time.monotonic() if now is None else now
        listed = {i.instance_id for s in self._sets for i in s.instances}
        for key in [k for k, (_r, seen) in self._reports.items() if k[0] not in listed and now - seen > UNLISTED_REPORT_TTL_S]:
            del self._reports[key]
        by_worker: dict[int, list[LoadMetrics]] = {}
        for (worker_id, _rank), (report, _seen) in self._reports.items():
            by_worker.setdefault(worker_id, []).append(report)
        out: dict[str, PoolObservation] = {}
        ready = self.ready_instances()
        routable = {i.instance_id for instances in ready.values() for i in instances}
        for gone in [i for i in self._ready_since if i not in routable]:
            del self._ready_since[gone]
        draining = self.draining_counts()
        for pool, instances in ready.items():
            for inst in instances:
                self._ready_since.setdefault(inst.instance_id, now)
            loads = tuple(
                _worker_load(r, now - self._ready_since[inst.instance_id])
                for inst in sorted(instances, key=lambda i: i.instance_id)
                for r in sorted(by_worker.get(inst.instance_id, ()), key=lambda r: r.dp_rank)
            )
            out[pool] = PoolObservation(pool=pool, ready=len(instances), loads=loads, draining=draining[pool])
        return out


def _worker_load(r: LoadMetrics, ready_for_s: float | None = None) -> WorkerLoad:
    return WorkerLoad(
        worker_id=r.worker_id,
        kv_usage=r.kv_usage,
        num_waiting=r.num_waiting,
        num_running=r.num_running,
        active_prefill_tokens=r.active_prefill_tokens,
        active_decode_blocks=r.active_decode_blocks,
        total_blocks=r.total_blocks,
        ready_for_s=ready_for_s,
        prefix_hit_rate=r.prefix_hit_rate,
    )
