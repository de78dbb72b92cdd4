"""``KvTransferDirectory``: transfer agents' records in discovery (``v1/kv_transfer/...``).

A worker publishes its agent's ``KvTransferMetadata`` under its lease, so the record vanishes with
the worker. A decode worker looks up the prefill worker named in ``KvTransferParams`` on every
disaggregated request, so lookups are served from a cache that a prefix watch keeps right: a
deleted key drops its entry, and a re-put key (a restarted prefill worker has a new agent, with new
NIXL metadata and a new port) replaces it before the next lookup sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, Lease, WatchEventKind
from dynamod.shared.errors import NotFoundError
from dynamod.shared.protocol.keys import kv_transfer_key, kv_transfer_prefix
from dynamod.shared.protocol.kv_transfer import (
    KvTransferMetadata,
    decode_transfer_metadata,
    encode_transfer_metadata,
)

logger = logging.getLogger(__name__)


class KvTransferDirectory:
    """Publish, withdraw and (cached) look up transfer agents of one namespace."""

    def __init__(self, store: DiscoveryStore, namespace: str) -> None:
        self._store = store
        self._namespace = namespace
        self._cache: dict[str, dict[int, KvTransferMetadata]] = {}  # component -> worker id -> record
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Condition()
        self._closed = False

    async def publish(self, component: str, meta: KvTransferMetadata, lease: Lease) -> None:
        key = kv_transfer_key(self._namespace, component, meta.worker_id)
        await self._store.put(key, encode_transfer_metadata(meta), lease)
        logger.info(
            "kv_transfer.published key=%s agent=%s backend=%s address=%s",
            key,
            meta.agent_name,
            meta.backend,
            meta.address,
        )

    async def withdraw(self, component: str, worker_id: int) -> None:
        key = kv_transfer_key(self._namespace, component, worker_id)
        await self._store.delete(key)
        self._cache.get(component, {}).pop(worker_id, None)
        logger.info("kv_transfer.withdrawn key=%s", key)

    async def lookup(
        self, worker_id: int, component: str = "prefill", *, timeout_s: float = 5.0
    ) -> KvTransferMetadata:
        """The agent of ``worker_id``, waiting up to ``timeout_s`` for a worker that has not
        published yet; NotFoundError when it does not appear."""
        cached = self._cache.get(component, {}).get(worker_id)
        if cached is not None:
            return cached
        self._ensure_watch(component)
        key = kv_transfer_key(self._namespace, component, worker_id)
        raw = await self._store.get(key)
        if raw is not None:
            meta = self._decode(key, raw)
            if meta is not None:
                return meta
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: worker_id in self._cache.get(component, {}))
        except TimeoutError:
            raise NotFoundError(
                f"no KV transfer agent for worker {worker_id:x} in {self._namespace}/{component} "
                f"(key {key}) within {timeout_s}s; the worker is gone or has not started its transfer agent"
            ) from None
        return self._cache[component][worker_id]

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._watches.values())
        self._watches.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._cache.clear()

    def _ensure_watch(self, component: str) -> None:
        task = self._watches.get(component)
        if self._closed or (task is not None and not task.done()):
            return
        self._watches[component] = asyncio.create_task(
            self._watch(component), name=f"kv-transfer-watch:{self._namespace}/{component}"
        )

    async def _watch(self, component: str) -> None:
        prefix = kv_transfer_prefix(self._namespace, component)
        records = self._cache.setdefault(component, {})
        try:
            async for event in self._store.watch_prefix(prefix):
                try:
                    worker_id = int(event.key[len(prefix) :], 16)
                except ValueError:
                    logger.warning("kv_transfer.ignored_key key=%s reason=not_a_worker_id", event.key)
                    continue
                if event.kind is WatchEventKind.PUT and event.value is not None:
                    meta = self._decode(event.key, event.value)
                    if meta is None:
                        records.pop(worker_id, None)
                    else:
                        records[worker_id] = meta
                else:
                    records.pop(worker_id, None)
                async with self._changed:
                    self._changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Entries that can no longer be kept right must not be served; the next lookup
            # reads the store and starts a new watch.
            records.clear()
            logger.warning("kv_transfer.watch_failed prefix=%s error=%s", prefix, exc)

    @staticmethod
    def _decode(key: str, raw: bytes) -> KvTransferMetadata | None:
        try:
            return decode_transfer_metadata(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("kv_transfer.malformed_record key=%s error=%s", key, exc)
            return None
