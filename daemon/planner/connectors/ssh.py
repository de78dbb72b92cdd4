"""The SSH connector: the planner starts and stops worker roles on the hosts of a ``dynamoctl
cluster`` inventory.

The inventory's ``agg``, ``prefill`` and ``decode`` roles are the *slots* of their pool, in
inventory order: a pool of N runs its first N slots. Scale-up starts the first stopped slots, the
way ``dynamoctl cluster up`` would (same commands, ``shared/cluster/roles.py``); scale-down takes
the last running ones, drains each through its ``drain`` control endpoint (its in-flight requests
finish, routers stop sending) and then stops it like ``dynamoctl cluster down`` (SIGTERM, whose
graceful path waits for stragglers, then SIGKILL). Ask for more workers than the inventory has
slots and the pool runs all of them, with a warning that names the inventory.

Ready counts come from discovery (a started role counts once its worker registered and is
routable), so this connector needs the cluster's discovery, as every planner has. A
``set_replicas`` returns once the request is queued; the work (SSH round trips, drains that wait
for requests) runs in one background task, the newest request next. The same counts again change
nothing, unless carrying them out failed (an unreachable host): then they are tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import defaultdict
from dataclasses import dataclass

from dynamod.shared.cluster.drain import drain_instances
from dynamod.shared.cluster.inventory import HostSpec, Inventory, RoleSpec, load_inventory
from dynamod.shared.cluster.pools import pool_instances, read_instances, read_ready_replicas
from dynamod.shared.cluster.roles import role_status, start_role, stop_role
from dynamod.shared.cluster.ssh import HostSession, SshError
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import POOL_COMPONENT, POOL_ROLE, POOLS
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

_POOL_BY_ROLE = {role: pool for pool, role in POOL_ROLE.items()}


@dataclass(frozen=True, slots=True, eq=False)
class Slot:
    """One worker role of the inventory: where it runs and what it serves (hashed by identity:
    the slots are made once, from the inventory)."""

    pool: str
    host: HostSpec
    role: RoleSpec

    @property
    def label(self) -> str:
        return f"{self.host.name}/{self.role.name}"


def inventory_slots(inv: Inventory) -> dict[str, list[Slot]]:
    """pool -> its slots in inventory order (every pool present)."""
    out: dict[str, list[Slot]] = {pool: [] for pool in POOLS}
    for host in inv.hosts:
        for role in host.roles:
            pool = _POOL_BY_ROLE.get(role.role)
            if pool is not None:
                out[pool].append(Slot(pool, host, role))
    return out


class SshConnector:
    """Starts and stops the inventory's worker roles over SSH to reach the desired counts."""

    name = "ssh"

    def __init__(
        self, runtime: DistributedRuntime, namespace: str, inventory_path: str, *, drain_timeout_s: float = 120.0
    ) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.namespace = namespace
        self.inventory_path = inventory_path
        self.drain_timeout_s = drain_timeout_s
        self.inventory: Inventory | None = None
        self.slots: dict[str, list[Slot]] = {}
        self.last_error = ""
        self._accepted: dict[str, int] | None = None  # the last request carried out without error
        self._latest: dict[str, int] | None = None
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()  # set while no request is waiting or being carried out
        self.idle.set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        path = await asyncio.to_thread(os.path.expanduser, self.inventory_path)
        self.inventory = await asyncio.to_thread(load_inventory, path)
        if self.inventory.cluster.namespace != self.namespace:
            logger.warning(
                "inventory namespace differs connector=ssh inventory=%s inventory_namespace=%s planner_namespace=%s",
                path, self.inventory.cluster.namespace, self.namespace,
            )
        self.slots = inventory_slots(self.inventory)
        if not any(self.slots.values()):
            raise ConfigError(f"{path}: no agg, prefill or decode roles: the SSH connector has no worker to start")
        self._task = asyncio.create_task(self._loop(), name="ssh-connector")
        logger.info(
            "connector started connector=ssh inventory=%s slots=%s", path,
            {p: [s.label for s in slots] for p, slots in self.slots.items() if slots},
        )

    async def ready_replicas(self) -> dict[str, int]:
        return await read_ready_replicas(self.store, self.namespace)

    async def set_replicas(self, desired: dict[str, int], decision_id: int) -> None:
        if desired == self._accepted or desired == self._latest:
            return
        unknown = [p for p in desired if p not in POOLS]
        if unknown:
            raise ConfigError(f"unknown pool(s) {', '.join(unknown)}; pools are {', '.join(POOLS)}")
        self._latest = dict(desired)
        self.idle.clear()
        self._wake.set()
        logger.info("scaling queued connector=ssh decision_id=%d desired=%s", decision_id, desired)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- carrying it out -----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            desired = self._latest
            if desired is None:
                continue
            try:
                await self.reconcile(desired)
                self._accepted, self.last_error = desired, ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an unreachable host must not end scaling
                self.last_error = str(exc)
                self._accepted = None
                logger.warning("scaling failed connector=ssh desired=%s error=%s", desired, exc)
            if self._latest == desired:
                self._latest = None
                self.idle.set()

    async def _running(self, slots: list[Slot]) -> dict[Slot, int]:
        """slot -> pid of the slots running now (one SSH session per host)."""
        by_host: dict[str, list[Slot]] = defaultdict(list)
        for slot in slots:
            by_host[slot.host.name].append(slot)

        async def on_host(host_slots: list[Slot]) -> list[tuple[Slot, int]]:
            async with HostSession(host_slots[0].host) as session:
                out = []
                for slot in host_slots:
                    assert self.inventory is not None
                    st = await role_status(session, self.inventory.cluster, slot.role)
                    if st.state == "running":
                        out.append((slot, st.pid))
                return out

        found = await asyncio.gather(*(on_host(s) for s in by_host.values()))
        return {slot: pid for group in found for slot, pid in group}

    async def reconcile(self, desired: dict[str, int]) -> None:
        """Starts and stops slots so each pool in ``desired`` runs that many."""
        assert self.inventory is not None
        failures: list[str] = []
        for pool, want in desired.items():
            slots = self.slots.get(pool, [])
            if want > len(slots):
                logger.warning(
                    "not enough slots connector=ssh pool=%s desired=%d slots=%d inventory=%s",
                    pool, want, len(slots), self.inventory.path,
                )
            if not slots:
                continue
            running = await self._running(slots)
            live = [s for s in slots if s in running]
            if want > len(live):
                for slot in [s for s in slots if s not in running][: want - len(live)]:
                    async with HostSession(slot.host) as session:
                        st = await start_role(session, self.inventory.cluster, slot.role)
                    logger.info("worker started connector=ssh pool=%s slot=%s state=%s pid=%d", pool, slot.label, st.state, st.pid)
                    if st.state == "error":
                        failures.append(f"{slot.label}: {st.detail}")
            elif want < len(live):
                victims = live[want:][::-1]  # the last slots go first
                results = await asyncio.gather(*(self._remove(slot, running[slot]) for slot in victims), return_exceptions=True)
                failures += [f"{s.label}: {r}" for s, r in zip(victims, results, strict=True) if isinstance(r, BaseException)]
        if failures:
            raise SshError("; ".join(failures))

    async def _remove(self, slot: Slot, pid: int) -> None:
        assert self.inventory is not None
        component = POOL_COMPONENT[slot.pool]
        mine = [i for i in pool_instances(await read_instances(self.store, self.namespace))[slot.pool] if i.pid == pid]
        # A pid names one process on one host; if two hosts' workers share it, drain neither by
        # mistake: the SIGTERM path still finishes in-flight work.
        nodes = {i.node for i in mine}
        ids = sorted({i.instance_id for i in mine}) if len(nodes) == 1 else []
        drained = await drain_instances(self.runtime, self.namespace, component, ids, self.drain_timeout_s)
        async with HostSession(slot.host) as session:
            st = await stop_role(session, self.inventory.cluster, slot.role)
        logger.info("worker stopped connector=ssh pool=%s slot=%s drained=%s state=%s", slot.pool, slot.label, drained, st.state)
        if st.state == "error":
            raise SshError(st.detail or "stop failed")
