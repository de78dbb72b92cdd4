"""Following one discovery key that holds a JSON wire struct (the planner's desired counts, an
orchestrator's acknowledgement): each new value, decoded; deletes and other keys under the same
prefix are skipped, and a value that does not decode is logged and skipped, so one bad writer
cannot stop the reader. The store's watch resumes across outages, so this one does too."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def watch_key(store: DiscoveryStore, key: str, type_: type[T]) -> AsyncIterator[T]:
    async for event in store.watch_prefix(key):
        if event.key != key or event.kind is not WatchEventKind.PUT or event.value is None:
            continue
        try:
            yield msgspec.json.decode(event.value, type=type_)
        except msgspec.DecodeError as exc:
            logger.warning("undecodable record key=%s type=%s error=%s", key, type_.__name__, exc)
