"""The virtual connector: the planner's counts go to discovery, an external orchestrator acts.

The planner writes ``DesiredReplicas`` (``v1/planner/{ns}/desired``, no lease: the request must
outlive a planner restart) and whoever carries it out answers with ``ScaledReplicas``
(``.../scaled``: the decision id it acted on and the counts it reached). This connector watches the
answer and logs what the orchestrator did: acknowledged (with how long it took and whether the
counts match), or nothing at all within ``ack_timeout_s`` (logged once per decision, so an
orchestrator that is down is visible in the planner's log rather than silently ignored).

Ready counts come from discovery, not from the orchestrator's report: a worker counts once its
``generate`` instance is registered and routable (``shared/cluster/pools.py``), so "scaled" is
measured the same way for every orchestrator. Dynamo's virtual connector does the same (its
coordinator's counts are targets, runtime discovery is the truth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec

from dynamod.shared.cluster.pools import read_ready_replicas
from dynamod.shared.discovery.key_watch import watch_key
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import DiscoveryError, DynamoError
from dynamod.shared.protocol.keys import planner_desired_key, planner_scaled_key
from dynamod.shared.protocol.planner import DesiredReplicas, ScaledReplicas

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingDecision:
    """The last counts written and not yet acknowledged."""

    decision_id: int
    replicas: dict[str, int]
    sent_at: float  # monotonic
    timed_out: bool = False


class VirtualConnector:
    """Writes desired counts to discovery and reads back what the orchestrator did."""

    name = "virtual"

    def __init__(self, store: DiscoveryStore, namespace: str, *, ack_timeout_s: float = 600.0) -> None:
        self.store = store
        self.namespace = namespace
        self.ack_timeout_s = ack_timeout_s
        self.desired_key = planner_desired_key(namespace)
        self.scaled_key = planner_scaled_key(namespace)
        self.last_written: DesiredReplicas | None = None
        self.last_scaled: ScaledReplicas | None = None
        self.pending: PendingDecision | None = None
        self.acknowledged = asyncio.Event()  # set whenever a ScaledReplicas arrives (tests, callers)
        self._watch_task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        raw = await self.store.get(self.desired_key)
        if raw is not None:
            # What a previous planner asked for: the same counts again are not rewritten.
            with contextlib.suppress(msgspec.DecodeError):
                self.last_written = msgspec.json.decode(raw, type=DesiredReplicas)
        self._watch_task = asyncio.create_task(self._watch_scaled(), name=f"{self.name}-connector-scaled")
        logger.info("connector started connector=%s namespace=%s ack_timeout_s=%g", self.name, self.namespace, self.ack_timeout_s)

    async def ready_replicas(self) -> dict[str, int]:
        return await read_ready_replicas(self.store, self.namespace)

    async def set_replicas(self, desired: dict[str, int], decision_id: int) -> None:
        if self.last_written is not None and self.last_written.replicas == desired:
            return  # idempotent: neither rewritten nor re-timed
        record = DesiredReplicas(replicas=dict(desired), decision_id=decision_id, ts=time.time(), planner=self.name)
        try:
            await self.store.put(self.desired_key, msgspec.json.encode(record))
        except DiscoveryError as exc:
            raise DynamoError(f"could not write the desired replica counts to {self.desired_key}: {exc}") from exc
        self.last_written = record
        self._await_ack(decision_id, dict(desired))
        logger.info("desired replicas written connector=%s decision_id=%d replicas=%s", self.name, decision_id, desired)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task

    # -- acknowledgement ---------------------------------------------------------------------------

    def _await_ack(self, decision_id: int, replicas: dict[str, int]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.pending = PendingDecision(decision_id, replicas, time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(self.ack_timeout_s, self._ack_overdue, decision_id)

    def _ack_overdue(self, decision_id: int) -> None:
        pending = self.pending
        if pending is None or pending.decision_id != decision_id:
            return
        pending.timed_out = True
        logger.warning(
            "scaling not acknowledged connector=%s decision_id=%d replicas=%s waited_s=%g key=%s "
            "hint=is the orchestrator watching this key?",
            self.name, decision_id, pending.replicas, self.ack_timeout_s, self.scaled_key,
        )

    def _on_scaled(self, scaled: ScaledReplicas) -> None:
        self.last_scaled = scaled
        self.acknowledged.set()
        pending = self.pending
        if pending is None or scaled.decision_id < pending.decision_id:
            logger.info(
                "orchestrator reports connector=%s decision_id=%d replicas=%s by=%s error=%s",
                self.name, scaled.decision_id, scaled.replicas, scaled.by or "-", scaled.error or "-",
            )
            return
        took = time.monotonic() - pending.sent_at
        reached = all(scaled.replicas.get(pool, 0) == n for pool, n in pending.replicas.items())
        log = logger.info if reached and not scaled.error else logger.warning
        log(
            "scaling acknowledged connector=%s decision_id=%d desired=%s reached=%s by=%s took_s=%.1f late=%s error=%s",
            self.name, scaled.decision_id, pending.replicas, scaled.replicas, scaled.by or "-", took,
            pending.timed_out, scaled.error or "-",
        )
        self.pending = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _watch_scaled(self) -> None:
        """The watch survives discovery outages (the store resumes it); a record that does not
        decode is logged and skipped, the orchestrator's bug must not stop the planner."""
        async for scaled in watch_key(self.store, self.scaled_key, ScaledReplicas):
            self._on_scaled(scaled)
