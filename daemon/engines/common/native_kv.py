"""An engine's native KV events as the worker's numbered ``RouterEvent`` stream, plus its dump.

The glue between ``NativeKvSubscriber`` (ordered native batches, gaps reported) and the worker
daemon (which publishes ``kv_events()`` and answers ``kv_dump``). Batches are converted by
``native_events`` (token ids rehashed with the router's hash, engine hashes kept to match
removals), recorded in a ``KvBlockTable`` (every cache tier, each with its medium) and queued.

``event_id`` is the worker's, consecutive over all ranks. Whenever events are known to be lost (a
native gap the replay could not fill, or a full queue) one id is left unused, so the router sees
the gap and re-reads ``kv_dump``, which the table answers as if nothing had been lost.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable

from dynamod.daemon.engines.common.event_queue import RouterEventQueue
from dynamod.daemon.engines.common.kv_table import KvBlockTable
from dynamod.daemon.engines.common.native_events import NativeEventConverter
from dynamod.shared.protocol.kv_events import MEDIA, MEDIUM_GPU, KvEvent, KvEventBatch, KvStored, RouterEvent

logger = logging.getLogger(__name__)

DEFAULT_EVENT_BUFFER = 65536


class NativeKvEventQueue:
    """Numbered router events from native batches; bounded, drops become id gaps."""

    def __init__(
        self,
        worker_id: int,
        *,
        buffer: int = DEFAULT_EVENT_BUFFER,
        mediums: Iterable[str] = MEDIA,
        cleared_medium: str | None = None,
    ) -> None:
        """``mediums``: the cache tiers passed on; ``cleared_medium``: what the engine's own
        ``AllBlocksCleared`` empties (None: every tier; an offloading vLLM: only the device)."""
        self.worker_id = worker_id
        self._converter = NativeEventConverter(worker_id, mediums=mediums, cleared_medium=cleared_medium)
        self.table = KvBlockTable()
        self._queue = RouterEventQueue(worker_id, buffer)
        self.gaps = 0
        # Blocks stored per (dp rank, lower tier) since start: an offloading engine's offloads.
        self.lower_stored: dict[tuple[int, str], int] = {}

    @property
    def dropped(self) -> int:
        """Events the full queue dropped (each an id gap the router recovers from)."""
        return self._queue.dropped

    @property
    def last_event_id(self) -> int:
        """The id of the last event handed out (or skipped); -1 before the first."""
        return self._converter.next_event_id - 1

    def on_batch(self, rank: int, batch: KvEventBatch) -> None:
        """A native batch, in order (``NativeKvSubscriber``'s handler)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = rank
        events = self._converter.convert(batch)
        self.table.apply_all(events)
        for ev in events:
            stored = ev.event
            if isinstance(stored, KvStored) and stored.medium != MEDIUM_GPU:
                key = (ev.dp_rank, stored.medium)
                self.lower_stored[key] = self.lower_stored.get(key, 0) + len(stored.blocks)
            self._queue.offer(ev)

    def on_gap(self, rank: int, missing: int) -> None:
        """Native batches were lost for good: skip an id so the router resyncs from the dump."""
        self.gaps += 1
        skipped = self._converter.skip()
        logger.warning(
            "kv events gap worker_id=%016x dp_rank=%d missing_batches=%d skipped_event_id=%d",
            self.worker_id, rank, missing, skipped,
        )

    def emit(self, rank: int, event: KvEvent) -> RouterEvent:
        """An event the adapter knows of before the engine publishes it (a cleared cache)."""
        ev = self._converter.stamp(rank, event)
        self.table.apply(rank, event)
        self._queue.offer(ev)
        return ev

    def events(self) -> AsyncIterator[RouterEvent]:
        """The router events in order (one consumer); ends after ``close()``."""
        return self._queue.stream()

    def dump(self) -> list[RouterEvent]:
        return self.table.dump(self.worker_id, max(self.last_event_id, 0))

    def close(self) -> None:
        self._queue.close()
