"""The local connector: the ``dynamod up`` supervisor on this host adds and removes workers.

The request travels the way the virtual connector's does (``DesiredReplicas`` in the cluster's
discovery, ``ScaledReplicas`` back), because the supervisor already watches that directory and the
planner may be its child or a process started by hand. What the local connector adds is the check
that somebody will act: the supervisor keeps a ``ScalerRecord`` under its lease at
``v1/planner/{ns}/scaler`` while it accepts scaling, so ``start`` fails with a message naming the
fix when there is none, and ``set_replicas`` refuses once it has gone (a planner whose supervisor
died would otherwise keep writing counts nobody reads, and log each one as "asked").
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from dynamod.daemon.planner.connectors.virtual import VirtualConnector
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import ConfigError, UnavailableError
from dynamod.shared.protocol.keys import planner_scaler_key
from dynamod.shared.protocol.planner import ScalerRecord
from dynamod.shared.runtime.watched_map import WatchedMap

logger = logging.getLogger(__name__)


class LocalConnector(VirtualConnector):
    """Desired counts for the ``dynamod up`` supervisor, which must be there to act on them."""

    name = "local"

    def __init__(
        self, store: DiscoveryStore, namespace: str, *, ack_timeout_s: float = 600.0, supervisor_wait_s: float = 30.0
    ) -> None:
        super().__init__(store, namespace, ack_timeout_s=ack_timeout_s)
        self.supervisor_wait_s = supervisor_wait_s
        self.scaler_key = planner_scaler_key(namespace)
        self.scaler: ScalerRecord | None = None
        self._scaler_seen = asyncio.Event()
        self._scaler_record: WatchedMap[ScalerRecord] = WatchedMap(
            store, self.scaler_key, lambda _key, raw: msgspec.json.decode(raw, type=ScalerRecord),
            what="scaler record", accepts=lambda key: key == self.scaler_key,
        )
        self._scaler_record.add_listener(self._on_scaler)

    async def start(self) -> None:
        await self._scaler_record.start()
        try:
            await asyncio.wait_for(self._scaler_seen.wait(), self.supervisor_wait_s)
        except TimeoutError:
            await self._scaler_record.close()
            raise ConfigError(
                f"no `dynamod up` supervisor accepts scaling on namespace {self.namespace!r} (nothing at "
                f"{self.scaler_key} after {self.supervisor_wait_s:g}s); start the cluster with `dynamod up --planner "
                "load|sla` (or `--accept-scaling`) using the same discovery directory and namespace"
            ) from None
        assert self.scaler is not None
        logger.info(
            "supervisor found connector=local pid=%d node=%s max_replicas=%s",
            self.scaler.pid, self.scaler.node, self.scaler.max_replicas,
        )
        await super().start()

    async def set_replicas(self, desired: dict[str, int], decision_id: int) -> None:
        scaler = self.scaler
        if scaler is None:
            raise UnavailableError(
                f"the `dynamod up` supervisor of namespace {self.namespace!r} is gone ({self.scaler_key} expired); "
                "nobody would add or remove workers"
            )
        over = {p: n for p, n in desired.items() if p in scaler.max_replicas and n > scaler.max_replicas[p]}
        if over:
            # The supervisor clamps too; say so here, where the planner's budget is decided.
            logger.warning("desired above the supervisor's budget connector=local desired=%s max=%s", over, scaler.max_replicas)
        await super().set_replicas(desired, decision_id)

    async def close(self) -> None:
        await self._scaler_record.close()
        await super().close()

    def _on_scaler(self, _key: str, record: ScalerRecord | None) -> None:
        if record is None:
            if self.scaler is not None:
                logger.warning("supervisor gone connector=local key=%s", self.scaler_key)
            self.scaler = None
            self._scaler_seen.clear()
        else:
            self.scaler = record
            self._scaler_seen.set()
