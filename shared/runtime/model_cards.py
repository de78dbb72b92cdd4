"""A live view of the model cards under a ``v1/mdc/...`` prefix, decoded, fed by a watch.

The frontend (which models exist, which workers serve them) and the router role (each worker's
block size, data-parallel size and LoRA adapters) both follow the model cards; this is the one
place that turns the watch into decoded cards, the way ``InstanceSet`` does for instances.

The set is a ``WatchedMap`` of the prefix: ``start()`` seeds from a listing (so a caller that
awaits it sees the current cards before it serves anything), then a watch from that listing keeps
the set current. A watch that fails with a ``DynamoError`` (including one a listener raises, e.g.
while opening a client for a new card's endpoint) is restarted after ``retry_s``: the set is first
reconciled with a fresh listing, so cards deleted meanwhile are reported deleted, and the card the
listener failed on is told again.

Listeners get ``(key, card)`` on every put and ``(key, None)`` when a card is gone; a listener may
be a coroutine function, and is then awaited before the next event, so every listener sees the
events in watch order. A card that fails to decode is logged and ignored (a previous good card
under the same key is kept); keys that are not model-card keys are ignored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.keys import MDC_ROOT, parse_key
from dynamod.shared.protocol.model_card import ModelCard, decode_card
from dynamod.shared.runtime.watched_map import DEFAULT_RETRY_S, WatchedMap

CardListener = Callable[[str, ModelCard | None], Awaitable[None] | None]
"""Called with (key, card) on put and (key, None) on removal; awaited when it returns an awaitable."""


def _is_card_key(key: str) -> bool:
    parsed = parse_key(key)
    return parsed is not None and parsed.root == MDC_ROOT


class ModelCardSet:
    def __init__(self, store: DiscoveryStore, prefix: str, *, retry_s: float = DEFAULT_RETRY_S) -> None:
        if not prefix.startswith(MDC_ROOT):
            raise ValueError(f"a model card prefix starts with {MDC_ROOT!r}, got {prefix!r}")
        self.prefix = prefix
        self._map: WatchedMap[ModelCard] = WatchedMap(
            store, prefix, lambda _key, raw: decode_card(raw), what="model card", accepts=_is_card_key, retry_s=retry_s
        )

    async def start(self) -> None:
        """Seeds from a listing (listeners are told, in key order) and starts the watch. A
        ``DynamoError`` from the listing is raised: a caller cannot start without its cards."""
        await self._map.start()

    async def close(self) -> None:
        await self._map.close()

    def add_listener(self, listener: CardListener) -> None:
        self._map.add_listener(listener)

    @property
    def cards(self) -> Mapping[str, ModelCard]:
        """The current cards by key (a read-only view that follows the watch)."""
        return self._map.view

    def get(self, key: str) -> ModelCard | None:
        return self._map.get(key)
