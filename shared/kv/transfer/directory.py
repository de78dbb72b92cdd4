"""``KvTransferDirectory``: transfer agents' records in discovery (``v1/kv_transfer/...``).

A worker publishes its agent's ``KvTransferMetadata`` under its lease, so the record vanishes with
the worker. A decode worker looks up the prefill worker named in ``KvTransferParams`` on every
disaggregated request, so lookups are served from a cache that a prefix watch (one ``WatchedMap``
per component, started by the first lookup) keeps right: a deleted key drops its entry, and a re-put
key (a restarted prefill worker has a new agent, with new NIXL metadata and a new port) replaces it
before the next lookup sees it. A record that does not decode drops its entry too: the agent it
replaced is gone. While a watch is failing its entries are not served (the store is read instead).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dynamod.shared.discovery.store import DiscoveryStore, Lease
from dynamod.shared.errors import NotFoundError
from dynamod.shared.protocol.keys import kv_transfer_key, kv_transfer_prefix
from dynamod.shared.protocol.kv_transfer import (
    KvTransferMetadata,
    decode_transfer_metadata,
    encode_transfer_metadata,
)
from dynamod.shared.runtime.watched_map import WatchedMap

logger = logging.getLogger(__name__)


class KvTransferDirectory:
    """Publish, withdraw and (cached) look up transfer agents of one namespace."""

    def __init__(self, store: DiscoveryStore, namespace: str) -> None:
        self._store = store
        self._namespace = namespace
        self._watched: dict[str, WatchedMap[KvTransferMetadata]] = {}  # component -> its records
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
        watched = self._watched.get(component)
        if watched is not None:
            await watched.apply(key, None)  # before the watch reports it: no lookup returns it
        logger.info("kv_transfer.withdrawn key=%s", key)

    def cached(self, worker_id: int, component: str = "prefill") -> KvTransferMetadata | None:
        """The agent of ``worker_id`` as the watch has it (no store read); None when not known or
        while the watch cannot vouch for its entries."""
        watched = self._watched.get(component)
        if watched is None or not watched.in_sync:
            return None
        return watched.get(kv_transfer_key(self._namespace, component, worker_id))

    async def lookup(
        self, worker_id: int, component: str = "prefill", *, timeout_s: float = 5.0
    ) -> KvTransferMetadata:
        """The agent of ``worker_id``, waiting up to ``timeout_s`` for a worker that has not
        published yet; NotFoundError when it does not appear."""
        cached = self.cached(worker_id, component)
        if cached is not None:
            return cached
        key = kv_transfer_key(self._namespace, component, worker_id)
        watched = await self._ensure_watch(component)
        cached = self.cached(worker_id, component)  # the seed listing may have it
        if cached is not None:
            return cached
        raw = await self._store.get(key)
        if raw is not None:
            try:
                return decode_transfer_metadata(raw)
            except ValueError as exc:  # msgspec's decode and validation errors are ValueErrors
                logger.warning("kv_transfer.malformed_record key=%s error=%s", key, exc)
        try:
            await watched.wait_for(lambda: watched.in_sync and key in watched, timeout_s)
        except TimeoutError:
            raise NotFoundError(
                f"no KV transfer agent for worker {worker_id:x} in {self._namespace}/{component} "
                f"(key {key}) within {timeout_s}s; the worker is gone or has not started its transfer agent"
            ) from None
        meta = watched.get(key)
        assert meta is not None
        return meta

    async def follow(self, component: str, listener: Callable[[str, KvTransferMetadata | None], None]) -> None:
        """Calls ``listener(key, record)`` for every agent of ``component`` published now, then on
        every change (``record`` None: withdrawn or unreadable), in order; starts the component's
        watch. The listener runs on the watch's path: it must not block (schedule work instead)."""
        watched = self._map(component)
        for key, meta in list(watched.view.items()):  # already seeded by a lookup: told first
            listener(key, meta)
        watched.add_listener(listener)
        await watched.start()

    async def close(self) -> None:
        self._closed = True
        watched = list(self._watched.values())
        self._watched.clear()
        await asyncio.gather(*(w.close() for w in watched), return_exceptions=True)

    async def _ensure_watch(self, component: str) -> WatchedMap[KvTransferMetadata]:
        """The component's map, started (seeded) on first use; one start however many lookups
        ask at once."""
        watched = self._map(component)
        await watched.start()
        return watched

    def _map(self, component: str) -> WatchedMap[KvTransferMetadata]:
        """The component's map, made (not started) on first use."""
        watched = self._watched.get(component)
        if watched is None:
            if self._closed:
                raise NotFoundError(f"the KV transfer directory of {self._namespace} is closed")
            prefix = kv_transfer_prefix(self._namespace, component)

            def decode(key: str, raw: bytes) -> KvTransferMetadata:
                int(key[len(prefix) :], 16)  # a key that names no worker id holds no agent's record
                return decode_transfer_metadata(raw)

            watched = WatchedMap(self._store, prefix, decode, what="kv_transfer record", drop_invalid=True)
            self._watched[component] = watched
        return watched
