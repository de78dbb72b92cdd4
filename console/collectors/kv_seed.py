"""KV seeder: reads each worker's cached blocks from its ``kv_dump`` endpoint.

KV events only tell what changed since the console subscribed, so a console started after traffic
showed "cached blocks 0" for a worker holding a full cache (issue 24 item 11), and a gap in a
worker's event ids left the count drifting. The router has the same problem and the same answer
(``kv_dump``, DESIGN.md): this asks every live worker once when it is first seen, and again after a
gap, and hands ``blocks as of event N`` to the state, which applies the events newer than the dump
on top (``LoadTally.apply_kv_seed``).

A few dumps at a time (a dump of a large cache is a few MB); a failed one is retried with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import StateSink
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol import control
from dynamod.shared.protocol.kv_events import KvStored, RouterEvent

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 4
DUMP_TIMEOUT_S = 15.0
RETRY_MIN_S = 2.0
RETRY_MAX_S = 60.0


def count_dump(frames: list[object]) -> tuple[int, int]:
    """(blocks, event id as of the dump) of a ``kv_dump`` reply; the id is -1 for an empty dump.
    Blocks are counted as the state counts stored events (every medium)."""
    blocks = 0
    event_id = -1
    for frame in frames:
        if not isinstance(frame, dict):
            continue
        for raw in frame.get("events") or ():
            ev = msgspec.convert(raw, RouterEvent)
            event_id = max(event_id, ev.event_id)
            if isinstance(ev.event, KvStored):
                blocks += len(ev.event.blocks)
    return blocks, event_id


class KvSeeder:
    """Every ``interval_s``, dumps the live workers whose count is not seeded (new, or after a gap)."""

    def __init__(self, runtime: DistributedRuntime, state: ClusterState, sink: StateSink, *, interval_s: float = 1.0) -> None:
        self._rt = runtime
        self._state = state
        self._sink = sink
        self._interval_s = interval_s
        self._clients: dict[tuple[str, str], EndpointClient] = {}
        self._running: set[int] = set()
        self._retry_at: dict[int, tuple[float, float]] = {}  # worker -> (not before, next delay)
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self.rounds = 0

    def pending(self) -> list[tuple[str, str, int]]:
        """(namespace, component, id) of live workers that serve ``kv_dump`` and need a seed now."""
        now = time.monotonic()
        out = []
        for w in self._state.worker_list(include_gone=False):
            iid = w.instance_id
            if (control.KV_DUMP in w.endpoints and not w.stats.kv_seeded and iid not in self._running
                    and self._retry_at.get(iid, (0.0, 0.0))[0] <= now):
                out.append((w.namespace, w.component, iid))
        return out

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                for ns, component, iid in self.pending():
                    self._running.add(iid)
                    tg.create_task(self._seed(ns, component, iid), name=f"console-kv-seed:{iid:x}")
                self.rounds += 1
                await asyncio.sleep(self._interval_s)

    async def _client(self, namespace: str, component: str) -> EndpointClient:
        client = self._clients.get((namespace, component))
        if client is None:
            client = await self._rt.namespace(namespace).component(component).endpoint(control.KV_DUMP).client()
            self._clients[(namespace, component)] = client
        return client

    async def _seed(self, namespace: str, component: str, iid: int) -> None:
        try:
            async with self._slots:
                client = await self._client(namespace, component)
                await client.instance_set.wait_for(lambda insts: any(i.instance_id == iid for i in insts), 5.0)
                frames = await client.call({}, instance_id=iid, timeout_s=DUMP_TIMEOUT_S)
            blocks, event_id = count_dump(frames)
        except (DynamoError, TimeoutError, OSError, msgspec.ValidationError) as exc:
            delay = self._retry_at.get(iid, (0.0, RETRY_MIN_S))[1]
            self._retry_at[iid] = (time.monotonic() + delay, min(delay * 2, RETRY_MAX_S))
            logger.info("kv_dump for the console failed worker_id=%016x error=%s retry_s=%.0f", iid, exc, delay)
            return
        finally:
            self._running.discard(iid)
        self._retry_at.pop(iid, None)
        self._sink.apply_kv_seed(iid, blocks, event_id)
        logger.info("console seeded kv blocks worker_id=%016x blocks=%d event_id=%d", iid, blocks, event_id)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
