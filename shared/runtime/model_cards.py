"""A live view of the model cards under a ``v1/mdc/...`` prefix, decoded, fed by a watch.

The frontend (which models exist, which workers serve them) and the router role (each worker's
block size, data-parallel size and LoRA adapters) both follow the model cards; this is the one
place that turns the watch into decoded cards, the way ``InstanceSet`` does for instances.

``start()`` seeds from a listing (so a caller that awaits it sees the current cards before it
serves anything), then a watch keeps the set current. A watch that fails with a ``DynamoError``
(including one a listener raises, e.g. while opening a client for a new card's endpoint) is
restarted after ``retry_s``: the set is first reconciled with a fresh listing, so cards deleted
meanwhile are reported deleted, and the new watch's snapshot puts every card again.

Listeners get ``(key, card)`` on every put and ``(key, None)`` when a card is gone; a listener may
be a coroutine function, and is then awaited before the next event, so every listener sees the
events in watch order. A card that fails to decode is logged and ignored (a previous good card
under the same key is kept); keys that are not model-card keys are ignored.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.keys import MDC_ROOT, parse_key
from dynamod.shared.protocol.model_card import ModelCard, decode_card

logger = logging.getLogger(__name__)

CardListener = Callable[[str, ModelCard | None], Awaitable[None] | None]
"""Called with (key, card) on put and (key, None) on removal; awaited when it returns an awaitable."""

DEFAULT_RETRY_S = 1.0


class ModelCardSet:
    def __init__(self, store: DiscoveryStore, prefix: str, *, retry_s: float = DEFAULT_RETRY_S) -> None:
        if not prefix.startswith(MDC_ROOT):
            raise ValueError(f"a model card prefix starts with {MDC_ROOT!r}, got {prefix!r}")
        self._store = store
        self.prefix = prefix
        self._retry_s = retry_s
        self._by_key: dict[str, ModelCard] = {}
        self._listeners: list[CardListener] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Seeds from a listing (listeners are told, in key order) and starts the watch. A
        ``DynamoError`` from the listing is raised: a caller cannot start without its cards."""
        if self._task is None:
            for key, value in sorted((await self._store.get_prefix(self.prefix)).items()):
                await self._apply_put(key, value)
            self._task = asyncio.create_task(self._watch(), name=f"model-cards-watch:{self.prefix}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def add_listener(self, listener: CardListener) -> None:
        self._listeners.append(listener)

    @property
    def cards(self) -> Mapping[str, ModelCard]:
        """The current cards by key (a read-only view that follows the watch)."""
        return MappingProxyType(self._by_key)

    def get(self, key: str) -> ModelCard | None:
        return self._by_key.get(key)

    # -- watch ------------------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                async for ev in self._store.watch_prefix(self.prefix):
                    if ev.kind is WatchEventKind.PUT and ev.value is not None:
                        await self._apply_put(ev.key, ev.value)
                    else:
                        await self._apply_delete(ev.key)
                return
            except DynamoError as exc:
                logger.warning("model card watch failed prefix=%s error=%s retry_in_s=%.1f", self.prefix, exc, self._retry_s)
                await asyncio.sleep(self._retry_s)
                try:
                    await self._reconcile()
                except DynamoError as again:
                    logger.debug("model card listing failed prefix=%s error=%s", self.prefix, again)

    async def _reconcile(self) -> None:
        """Reports the cards deleted while the watch was down (the next watch's snapshot puts the
        others again)."""
        live = await self._store.get_prefix(self.prefix)
        for key in [k for k in self._by_key if k not in live]:
            await self._apply_delete(key)

    async def _apply_put(self, key: str, value: bytes) -> None:
        parsed = parse_key(key)
        if parsed is None or parsed.root != MDC_ROOT:
            return
        try:
            card = decode_card(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed model card key=%s error=%s", key, exc)
            return
        self._by_key[key] = card
        await self._notify(key, card)

    async def _apply_delete(self, key: str) -> None:
        if self._by_key.pop(key, None) is not None:
            await self._notify(key, None)

    async def _notify(self, key: str, card: ModelCard | None) -> None:
        for listener in self._listeners:
            result = listener(key, card)
            if inspect.isawaitable(result):
                await result
