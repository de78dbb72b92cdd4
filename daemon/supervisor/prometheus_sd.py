"""``dynamod up --prometheus-sd PATH``: keeps a Prometheus file_sd file of this cluster current.

The groups and labels are discovery's (``shared/observability/file_sd.py``, what ``dynamoctl
targets --prometheus`` prints), with one thing only the supervisor knows: which workers *should*
be running. A worker that dies drops out of discovery within one lease TTL, and a target that
vanishes is no alert (``up`` has no series to be 0). So a worker the supervisor still wants, being
restarted or given up on after a crash loop (``failed.py``), keeps its last target group in the
file and Prometheus sees ``up == 0`` (``DynamodWorkerDown`` in deploy/prometheus/rules.yml). A
worker the scaler retired, or the whole cluster on shutdown, leaves the file: that is intended.
The restarted worker keeps its status port (``WorkerFactory``), so the kept target is its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from dynamod.daemon.supervisor.children import Supervisor
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.observability.file_sd import TargetGroup, read_target_groups, write_file
from dynamod.shared.tasks import stop_task

logger = logging.getLogger(__name__)

REFRESH_S = 1.0  # discovery is re-read this often; the file is rewritten only when it changes


class PrometheusSdWriter:
    """Rewrites ``path`` from discovery every ``refresh_s`` while the cluster runs."""

    def __init__(
        self, supervisor: Supervisor, path: Path, file_kv: str, namespace: str, *, refresh_s: float = REFRESH_S
    ) -> None:
        self._supervisor = supervisor
        self._path = path
        self._file_kv = file_kv
        self._namespace = namespace
        self._refresh_s = refresh_s
        self._last_seen: dict[str, TargetGroup] = {}  # worker name -> its group when last in discovery
        self._store: DiscoveryStore | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # Written before the first child starts: Prometheus may be pointed at it at once.
        await asyncio.to_thread(write_file, self._path, [])
        self._store = make_store("file", file_root=self._file_kv)
        await self._store.start()
        self._task = asyncio.create_task(self._run(), name="prometheus-sd")

    def groups(self, discovered: list[TargetGroup]) -> list[TargetGroup]:
        """``discovered`` plus the last group of every wanted worker missing from it."""
        wanted = {c.spec.name for c in self._supervisor.children if not c.retiring}
        present = set()
        for group in discovered:
            name = group["labels"].get("worker_name")
            if name:
                present.add(name)
                self._last_seen[name] = group
        for name in list(self._last_seen):
            if name not in wanted:
                del self._last_seen[name]
        kept = [g for n, g in sorted(self._last_seen.items()) if n not in present]
        addresses = {t for g in discovered for t in g["targets"]}
        # A restarted worker may already be back under a new id at the same address: one target.
        return discovered + [g for g in kept if not set(g["targets"]) & addresses]

    async def refresh(self) -> bool:
        assert self._store is not None
        groups = self.groups(await read_target_groups(self._store, self._namespace))
        wrote = await asyncio.to_thread(write_file, self._path, groups)
        if wrote:
            logger.info("prometheus file_sd written path=%s targets=%d", self._path, len(groups))
        return wrote

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except OSError as exc:  # a full disk or a removed directory must not stop the cluster
                logger.warning("prometheus file_sd not written path=%s error=%s", self._path, exc)
            await asyncio.sleep(self._refresh_s)

    async def close(self) -> None:
        """Stops refreshing and empties the file: a stopped cluster is no set of down targets."""
        await stop_task(self._task)
        if self._store is not None:
            await self._store.close()
        with contextlib.suppress(OSError):
            await asyncio.to_thread(write_file, self._path, [])
