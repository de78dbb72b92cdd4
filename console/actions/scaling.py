"""Scaling a pool by hand: the ``ScaleOverride`` an operator writes and clears, shared by the
console's scale keys and ``dynamoctl scale``.

An override is a plain discovery key (``v1/planner/{ns}/override/{pool}``, JSON, no lease): it must
outlive the tool that wrote it, and the planner keeps the pool at that count until the key is
deleted. Nothing here talks to the planner; the planner reads the key on its next interval.

Before writing, the pool is checked against what the cluster knows (a planner's status or workers
of that role in the namespace), so a typo such as ``prefil`` is refused instead of creating a key
nothing reads. Like ``ControlClient``, nothing raises for a cluster-side problem: every outcome
comes back as an ``ActionResult`` with a one-line message.
"""

from __future__ import annotations

import getpass
import logging
import socket
import time

import msgspec

from dynamod.console.actions.control import ActionResult
from dynamod.console.collectors.discovery import DiscoveryCollector
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.scaling import PoolScaling
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.keys import planner_override_key
from dynamod.shared.protocol.planner import POOLS, ScaleOverride

logger = logging.getLogger(__name__)

ACTION_SCALE = "scale"
ACTION_CLEAR = "scale clear"
MAX_REPLICAS = 10_000  # a sanity bound: a count above it is a typo, not a plan


def operator_name() -> str:
    """Who set an override (``user@host``), shown beside it so a team knows whom to ask."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def check_replicas(replicas: int) -> str | None:
    """Why ``replicas`` is not a count an operator can ask for, or None."""
    if replicas < 0:
        return f"replicas must be 0 or more, got {replicas}"
    if replicas > MAX_REPLICAS:
        return f"replicas must be at most {MAX_REPLICAS}, got {replicas}"
    return None


def find_pool(pools: list[PoolScaling], namespace: str, pool: str) -> PoolScaling | str:
    """The pool, or why it cannot be scaled (unknown name, nothing of that kind in the namespace)."""
    if pool not in POOLS:
        return f"unknown pool {pool!r}: pools are {', '.join(POOLS)}"
    for p in pools:
        if p.namespace == namespace and p.pool == pool:
            return p
    here = sorted(p.pool for p in pools if p.namespace == namespace)
    if here:
        return f"namespace {namespace} has no {pool} pool (it has {', '.join(here)})"
    return f"namespace {namespace} has no planner and no workers"


def describe_change(p: PoolScaling, replicas: int) -> str:
    """What setting ``replicas`` means for the pool, in one line."""
    now = f"{p.ready} ready"
    if p.desired is not None:
        now += f", planner wants {p.desired}"
    text = f"{p.key} held at {replicas} ({now})"
    low, high = p.min_replicas, p.max_replicas
    if (low is not None and replicas < low) or (high and replicas > high):
        text += f"; outside the planner's budget {low or 0}-{high or '?'}: the override wins"
    if not p.planner:
        text += "; no planner runs in this namespace: nothing acts on it until one does"
    return text


class ScaleClient:
    """Writes and deletes overrides through a discovery store (the runtime's, or one opened for a
    single ``dynamoctl`` command)."""

    def __init__(self, store: DiscoveryStore, *, set_by: str | None = None) -> None:
        self._store = store
        self._set_by = set_by

    async def pools(self, namespace: str | None = None) -> list[PoolScaling]:
        """The pools as the console sees them, from one listing of discovery (no event plane:
        the decisions are not in it, the planner's status and the workers are)."""
        state = ClusterState()
        await DiscoveryCollector(self._store, state, namespace=namespace).sync()
        return state.scaling_pools()

    async def _pool(self, action: str, namespace: str, pool: str) -> PoolScaling | ActionResult:
        target = f"{namespace}/{pool}"
        try:
            found = find_pool(await self.pools(namespace), namespace, pool)
        except (DynamoError, OSError) as exc:
            return ActionResult(action, target, False, f"cannot read discovery: {exc}")
        return ActionResult(action, target, False, found) if isinstance(found, str) else found

    async def set_override(self, namespace: str, pool: str, replicas: int, *, reason: str = "") -> ActionResult:
        target = f"{namespace}/{pool}"
        bad = check_replicas(replicas)
        if bad is not None:
            return ActionResult(ACTION_SCALE, target, False, bad)
        found = await self._pool(ACTION_SCALE, namespace, pool)
        if isinstance(found, ActionResult):
            return found
        override = ScaleOverride(replicas=replicas, set_by=self._set_by or operator_name(), ts=time.time(), reason=reason)
        try:
            await self._store.put(planner_override_key(namespace, pool), msgspec.json.encode(override))
        except (DynamoError, OSError) as exc:
            return ActionResult(ACTION_SCALE, target, False, f"cannot write the override: {exc}")
        logger.info("scale override set namespace=%s pool=%s replicas=%d by=%s", namespace, pool, replicas, override.set_by)
        return ActionResult(ACTION_SCALE, target, True, describe_change(found, replicas),
                            {"namespace": namespace, "pool": pool, "override": msgspec.to_builtins(override)})

    async def clear_override(self, namespace: str, pool: str) -> ActionResult:
        target = f"{namespace}/{pool}"
        found = await self._pool(ACTION_CLEAR, namespace, pool)
        if isinstance(found, ActionResult):
            return found
        if found.override is None:
            return ActionResult(ACTION_CLEAR, target, True, f"{target} has no override: nothing to clear",
                                {"namespace": namespace, "pool": pool, "cleared": None})
        try:
            await self._store.delete(planner_override_key(namespace, pool))
        except (DynamoError, OSError) as exc:
            return ActionResult(ACTION_CLEAR, target, False, f"cannot delete the override: {exc}")
        logger.info("scale override cleared namespace=%s pool=%s", namespace, pool)
        who = "the planner sizes it again" if found.planner else "no planner runs in this namespace"
        return ActionResult(ACTION_CLEAR, target, True, f"{target} override {found.override.replicas} cleared: {who}",
                            {"namespace": namespace, "pool": pool, "cleared": msgspec.to_builtins(found.override)})
