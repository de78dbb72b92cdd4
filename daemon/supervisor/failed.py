"""The workers ``dynamod up`` gave up on, in discovery; and ``dynamoctl restart NAME`` carried out.

A crash-looping worker whose pool still has other workers is given up on alone (``children.py``):
the cluster keeps serving. This keeps the operator's view whole: a ``FailedWorker`` record per
such worker (``shared/protocol/supervisor.py``) under this supervisor's lease, so ``dynamoctl
status`` and the console can show it, deleted once it runs again. It also watches for
``RestartRequest`` keys and restarts the named worker with a fresh crash count, deleting the
request either way (a request for a worker that is not failed is answered by deleting it and a
log line: there is nothing to do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import msgspec

from dynamod.daemon.supervisor.children import Child, Supervisor
from dynamod.shared.discovery.store import WatchEventKind
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.supervisor import (
    FailedWorker,
    RestartRequest,
    failed_key,
    failed_prefix,
    restart_prefix,
)
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)


def failed_record(child: Child) -> FailedWorker:
    loop = child.failed
    assert loop is not None
    return FailedWorker(
        name=child.spec.name, pool=child.spec.pool or "", reason=loop.last_reason, crashes=loop.crashes,
        window_s=loop.window_s, log=str(loop.log_path or ""), supervisor_pid=os.getpid(), ts=time.time(),
    )


class FailedWorkers:
    """Publishes the supervisor's failed children and serves restart requests (see the module
    docstring). ``changed`` is the supervisor's ``on_change`` listener."""

    def __init__(self, supervisor: Supervisor, runtime: DistributedRuntime) -> None:
        self.supervisor = supervisor
        self.runtime = runtime
        self.namespace = runtime.settings.namespace
        self._published: set[str] = set()
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def changed(self) -> None:
        self._dirty.set()

    async def start(self) -> None:
        store = self.runtime.store
        # Records left by an earlier `up` of this namespace name workers that are not ours.
        for key in await store.get_prefix(failed_prefix(self.namespace)):
            await store.delete(key)
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="failed-workers-publish"),
            asyncio.create_task(self._serve_restarts(), name="failed-workers-restart"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _publish_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.sync()
            except (DynamoError, OSError) as exc:  # discovery hiccup: try again on the next change or in 1 s
                logger.warning("failed workers not published error=%s action=retry", exc)
                await asyncio.sleep(1.0)
                self._dirty.set()

    async def sync(self) -> None:
        """Discovery's ``failed/`` keys to match the supervisor's failed children."""
        store, lease = self.runtime.store, self.runtime.lease
        failed = {c.spec.name: c for c in self.supervisor.failed}
        for name, child in failed.items():
            if name not in self._published:
                await store.put(failed_key(self.namespace, name), msgspec.json.encode(failed_record(child)), lease)
                self._published.add(name)
                logger.info("failed worker published name=%s", name)
        for name in sorted(self._published - failed.keys()):
            await store.delete(failed_key(self.namespace, name))
            self._published.discard(name)

    async def _serve_restarts(self) -> None:
        store = self.runtime.store
        prefix = restart_prefix(self.namespace)
        for key in await store.get_prefix(prefix):  # asked before this `up` started: not for its workers
            await store.delete(key)
        async for event in store.watch_prefix(prefix):
            if event.kind is not WatchEventKind.PUT or event.value is None:
                continue
            try:
                request = msgspec.json.decode(event.value, type=RestartRequest)
            except msgspec.DecodeError as exc:
                logger.warning("undecodable restart request key=%s error=%s", event.key, exc)
                await store.delete(event.key)
                continue
            await self._restart(request)
            await store.delete(event.key)

    async def _restart(self, request: RestartRequest) -> None:
        try:
            await self.supervisor.restart(request.name)
        except KeyError:
            logger.warning("restart request for an unknown worker name=%s by=%s", request.name, request.by)
        except DynamoError as exc:
            logger.warning("restart request not carried out name=%s by=%s reason=%s", request.name, request.by, exc)
        else:
            print(f"dynamod up: restarting {request.name} (asked by {request.by or 'dynamoctl'})", flush=True)
