"""A decode worker's transfer agent connected to each prefill worker as that worker appears.

Without it, the first disaggregated request between a decode and a prefill worker pays for the
connection: a pooled block-server connection (and its TLS handshake and token hello on a secured
cluster) and, over NIXL, adding the peer, preparing its 16k block descriptors and the UCX wire-up
inside the first READ. Measured on this host: the first streamed NIXL read of a fresh peer took
61-95 ms against 0.3-0.6 ms after it, and on a new 1P+3D cluster the first short request reaching
each decode worker took 100-123 ms to its first token against 35-41 ms later. That is the cost of
every scale-up (a planner's new prefill worker), restart and startup burst, and the disaggregation
policy learns it as the remote path's overhead.

``PeerWarmer`` follows the prefill component's records in the transfer directory and calls the
agent's ``connect`` for each new or re-published one, in the background (the watch is never
held up); a failure is logged and left to the first read, which connects on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dynamod.shared.errors import DynamoError
from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.kv.transfer.directory import KvTransferDirectory
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata
from dynamod.shared.tasks import stop_task

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 10.0


class PeerWarmer:
    """Connects ``agent`` to every agent of ``component`` in ``directory`` as it is published."""

    def __init__(
        self, agent: KvTransferAgent, directory: KvTransferDirectory, component: str,
        timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self._agent = agent
        self._directory = directory
        self._component = component
        self._timeout_s = timeout_s
        self._tasks: dict[str, asyncio.Task[None]] = {}  # record key -> its connect
        self.connected = 0  # peers connected so far (tests and logs)

    async def start(self) -> None:
        """Follows the component's records (those already published are connected at once)."""
        await self._directory.follow(self._component, self._on_record)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            await stop_task(task)

    def _on_record(self, key: str, meta: KvTransferMetadata | None) -> None:
        previous = self._tasks.pop(key, None)
        if previous is not None and not previous.done():
            previous.cancel()  # withdrawn or replaced (a restarted peer): its old agent is gone
        if meta is None:
            return
        self._tasks[key] = asyncio.create_task(self._connect(key, meta), name=f"kv-peer-connect:{meta.agent_name}")

    async def _connect(self, key: str, meta: KvTransferMetadata) -> None:
        started = time.monotonic()
        own = self._agent.metadata().agent_name
        try:
            await self._agent.connect(meta, timeout_s=self._timeout_s)
        except DynamoError as exc:  # KvTransferError, KvTransferTimeout: the first read connects itself
            logger.warning(
                "kv_transfer.peer_connect_failed agent=%s remote=%s worker_id=%016x address=%s error=%s",
                own, meta.agent_name, meta.worker_id, meta.address, exc,
            )
            return
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
        self.connected += 1
        logger.info(
            "kv_transfer.peer_connected agent=%s remote=%s worker_id=%016x backend=%s ms=%.1f",
            own, meta.agent_name, meta.worker_id, meta.backend, (time.monotonic() - started) * 1000.0,
        )
