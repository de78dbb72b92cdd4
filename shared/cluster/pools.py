"""Ready workers per planner pool, as discovery shows them.

A pool's worker is counted when its ``generate`` instance is registered with the pool's component
and role and is routable (``ready``): a worker that is starting (not registered yet), draining or
asleep takes no new work, so a planner must not count it as capacity. This is the one definition
the connectors and the ``dynamod up`` supervisor share, so "the planner asked for 3 and the
supervisor reports 3" means the same thing on both sides.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.protocol.planner import POOL_COMPONENT, POOLS, pool_of_role

GENERATE_ENDPOINT = "generate"


def pool_of(inst: Instance) -> str | None:
    """The planner pool a ``generate`` instance belongs to, or None (another endpoint or role)."""
    if inst.endpoint != GENERATE_ENDPOINT:
        return None
    pool = pool_of_role(inst.role)
    return pool if pool is not None and inst.component == POOL_COMPONENT[pool] else None


def pool_instances(records: Iterable[Instance]) -> dict[str, list[Instance]]:
    """pool -> its workers' ``generate`` instances (every status), every pool present."""
    out: dict[str, list[Instance]] = {pool: [] for pool in POOLS}
    for inst in records:
        pool = pool_of(inst)
        if pool is not None:
            out[pool].append(inst)
    return out


def count_ready(records: Iterable[Instance]) -> dict[str, int]:
    """pool -> routable workers, every pool present (0 when it has none)."""
    return {pool: sum(1 for i in insts if i.routable) for pool, insts in pool_instances(records).items()}


async def read_instances(store: DiscoveryStore, namespace: str) -> list[Instance]:
    """The namespace's instance records; a record that does not decode is skipped (a newer writer's)."""
    out = []
    for value in (await store.get_prefix(instances_prefix(namespace))).values():
        try:
            out.append(decode_instance(value))
        except msgspec.DecodeError:
            continue
    return out


async def read_ready_replicas(store: DiscoveryStore, namespace: str) -> dict[str, int]:
    """pool -> ready workers in ``namespace`` now."""
    return count_ready(await read_instances(store, namespace))
