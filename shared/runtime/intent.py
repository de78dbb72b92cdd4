"""Reading and writing operator intent (``WorkerIntent``) in discovery.

``IntentRecorder`` is one worker's view: it loads the intent once at start, and each change the
operator makes is written through a ``RetryingWrite``: when discovery does not take the write (an
etcd outage), it is retried in the background until it does, so a drain sent during an outage is
still remembered after the worker's next restart. Writes are plain ``put``s without a lease (every
backend keeps those until deleted), and an intent with nothing left to re-apply is deleted rather
than stored.

``list_intents`` / ``clear_intent`` serve tools (``dynamoctl intent``) that look at intent of
workers that may be gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import STATUS_SLEEPING
from dynamod.shared.protocol.intent import WorkerIntent, decode_intent, encode_intent
from dynamod.shared.protocol.keys import INTENT_ROOT, intent_key, intent_prefix
from dynamod.shared.runtime.retrying_write import RetryingWrite

logger = logging.getLogger(__name__)


class IntentRecorder:
    """The stored intent of the worker ``worker_name`` in ``namespace``/``component``."""

    def __init__(self, store: DiscoveryStore, namespace: str, component: str, worker_name: str) -> None:
        self.key = intent_key(namespace, component, worker_name)  # validates the name
        self.worker_name = worker_name
        self._store = store
        self._lock = asyncio.Lock()
        self.current = WorkerIntent()  # what the worker does now; the store follows (see ``pending``)
        self._writes: RetryingWrite[WorkerIntent] = RetryingWrite(f"intent {self.key}", self._store_intent)

    @property
    def pending(self) -> bool:
        """A change is not in discovery yet (it is being retried)."""
        return self._writes.pending

    async def close(self) -> None:
        if self._writes.pending:
            logger.warning("intent not saved before stop worker_name=%s error=%s", self.worker_name, self._writes.last_error)
        await self._writes.close()

    async def load(self) -> WorkerIntent:
        """Reads the stored intent. An unreadable value is logged and treated as no intent: a worker
        must still start, and its next recorded change replaces the value."""
        raw = await self._store.get(self.key)
        intent = WorkerIntent()
        if raw is not None:
            try:
                intent = decode_intent(raw)
            except msgspec.DecodeError as exc:
                logger.warning("intent unreadable, ignored key=%s error=%s", self.key, exc)
        self.current = intent
        return intent

    async def set_status(self, status: str, sleep_level: int = 0, *, set_by: str) -> bool:
        """Records ``ready`` (clears drain and sleep), ``draining`` or ``sleeping`` at a level.
        Like every change: True once in discovery, False while the write is being retried."""
        async with self._lock:
            level = sleep_level if status == STATUS_SLEEPING else 0
            return await self._write(msgspec.structs.replace(self.current, status=status, sleep_level=level), set_by)

    async def add_lora(self, name: str, source: str, *, set_by: str) -> bool:
        async with self._lock:
            return await self._write(msgspec.structs.replace(self.current, loras={**self.current.loras, name: source}), set_by)

    async def remove_loras(self, names: list[str], *, set_by: str) -> bool:
        async with self._lock:
            loras = {k: v for k, v in self.current.loras.items() if k not in names}
            return await self._write(msgspec.structs.replace(self.current, loras=loras), set_by)

    async def _write(self, intent: WorkerIntent, set_by: str) -> bool:
        if intent.same_as(self.current) and not self._writes.pending:
            return True
        intent = msgspec.structs.replace(intent, ts=time.time(), set_by=set_by)
        self.current = intent
        return await self._writes.submit(intent)

    async def _store_intent(self, intent: WorkerIntent) -> None:
        if intent.empty:
            await self._store.delete(self.key)
        else:
            await self._store.put(self.key, encode_intent(intent))  # no lease: it outlives the process
        logger.info(
            "intent saved worker_name=%s status=%s sleep_level=%d loras=%s set_by=%s",
            self.worker_name, intent.status, intent.sleep_level, ",".join(sorted(intent.loras)) or "-", intent.set_by,
        )


@dataclass(frozen=True, slots=True)
class StoredIntent:
    """One intent key as found in discovery; ``intent`` is None when the value does not decode."""

    namespace: str
    component: str
    worker_name: str
    intent: WorkerIntent | None
    error: str = ""

    @property
    def key(self) -> str:
        return intent_key(self.namespace, self.component, self.worker_name)


async def list_intents(store: DiscoveryStore, namespace: str | None = None) -> list[StoredIntent]:
    """Every stored intent (of one namespace, or all), sorted by key; keys of another layout are skipped."""
    out: list[StoredIntent] = []
    for key, raw in sorted((await store.get_prefix(intent_prefix(namespace))).items()):
        parts = key[len(INTENT_ROOT):].split("/")
        if len(parts) != 3 or not all(parts):
            continue
        try:
            out.append(StoredIntent(*parts, intent=decode_intent(raw)))
        except msgspec.DecodeError as exc:
            out.append(StoredIntent(*parts, intent=None, error=str(exc)))
    return out


async def clear_intent(store: DiscoveryStore, namespace: str, component: str, worker_name: str) -> bool:
    """Deletes one worker's intent; False when there was none. (A running worker keeps its state
    and would write the intent again on its next change: this is for workers that are gone.)"""
    key = intent_key(namespace, component, worker_name)
    if await store.get(key) is None:
        return False
    await store.delete(key)
    return True

