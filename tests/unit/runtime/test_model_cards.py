"""ModelCardSet: the decoded model cards of a prefix, seeded then watched, told to listeners."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.discovery.store import DiscoveryStore, PrefixListing, WatchEvent
from dynamod.shared.errors import DiscoveryError
from dynamod.shared.protocol.keys import mdc_key, mdc_prefix
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.runtime.model_cards import ModelCardSet
from tests.unit.runtime.support import until

NS = "ns"


def card(name: str, block_size: int = 16, lora: str | None = None) -> bytes:
    return encode_card(ModelCard(served_model_name=name, kv_block_size=block_size, lora=lora))


def key(iid: int, component: str = "backend", lora: str | None = None) -> str:
    return mdc_key(NS, component, "generate", iid, lora)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []  # (key, served name or None on delete)

    def __call__(self, k: str, c: ModelCard | None) -> None:
        self.events.append((k, None if c is None else c.served_model_name))


async def test_seed_is_told_in_key_order_before_start_returns(store: DiscoveryStore) -> None:
    await store.put(key(2), card("b"))
    await store.put(key(1), card("a"))
    await store.put(key(1, lora="ad"), card("a-ad", lora="ad"))
    cards = ModelCardSet(store, mdc_prefix(NS))
    seen = Recorder()
    cards.add_listener(seen)
    await cards.start()
    try:
        assert seen.events == [(key(1), "a"), (key(1, lora="ad"), "a-ad"), (key(2), "b")]
        assert cards.get(key(2)) is not None and cards.get(key(2)).served_model_name == "b"
        assert cards.get(key(1, lora="ad")).lora == "ad"
        assert set(cards.cards) == {key(1), key(1, lora="ad"), key(2)}
    finally:
        await cards.close()


async def test_put_update_and_delete_reach_listeners(store: DiscoveryStore) -> None:
    cards = ModelCardSet(store, mdc_prefix(NS))
    seen = Recorder()
    cards.add_listener(seen)
    await cards.start()
    try:
        await store.put(key(1), card("a", block_size=16))
        await until(lambda: (key(1), "a") in seen.events)
        await store.put(key(1), card("a", block_size=32))
        await until(lambda: cards.get(key(1)) is not None and cards.get(key(1)).kv_block_size == 32)
        await store.delete(key(1))
        await until(lambda: (key(1), None) in seen.events)
        assert cards.get(key(1)) is None
        assert seen.events[-1] == (key(1), None)
        assert all(k == key(1) for k, _ in seen.events)
    finally:
        await cards.close()


async def test_listeners_see_every_event_in_order_async_ones_awaited(store: DiscoveryStore) -> None:
    order: list[str] = []

    async def slow(k: str, c: ModelCard | None) -> None:
        order.append(f"slow-start:{c.served_model_name if c else '-'}")
        await asyncio.sleep(0.01)  # a listener doing I/O: the next event waits for it
        order.append(f"slow-end:{c.served_model_name if c else '-'}")

    def fast(k: str, c: ModelCard | None) -> None:
        order.append(f"fast:{c.served_model_name if c else '-'}")

    await store.put(key(1), card("a"))
    cards = ModelCardSet(store, mdc_prefix(NS))
    cards.add_listener(slow)
    cards.add_listener(fast)
    await cards.start()
    try:
        await store.put(key(2), card("b"))
        await until(lambda: "fast:b" in order)
        await store.delete(key(1))
        await until(lambda: "fast:-" in order)
        # The watch's snapshot puts "a" again after the seed: listeners may see a card twice.
        assert order[:3] == ["slow-start:a", "slow-end:a", "fast:a"]
        tail = order[order.index("slow-start:b"):]
        assert tail == ["slow-start:b", "slow-end:b", "fast:b", "slow-start:-", "slow-end:-", "fast:-"]
    finally:
        await cards.close()


async def test_malformed_card_is_ignored_and_the_good_one_kept(store: DiscoveryStore) -> None:
    await store.put(key(1), card("a"))
    await store.put(key(2), b"{not json")
    await store.put(f"{mdc_prefix(NS)}not/a/card-key", card("x"))
    cards = ModelCardSet(store, mdc_prefix(NS))
    seen = Recorder()
    cards.add_listener(seen)
    await cards.start()
    try:
        assert seen.events == [(key(1), "a")]
        await store.put(key(1), b'{"served_model_name": 7}')
        await store.put(key(3), card("c"))
        await until(lambda: (key(3), "c") in seen.events)
        assert cards.get(key(1)).served_model_name == "a"
        assert key(2) not in cards.cards
        assert all(name is not None for _, name in seen.events)  # nothing reported deleted
    finally:
        await cards.close()


def test_prefix_must_be_a_model_card_prefix() -> None:
    with pytest.raises(ValueError):
        ModelCardSet(MemStore(), "v1/instances/ns/")


class FailingOnce:
    """A mem store whose first watch fails right after the seed listing, as a backend outage would."""

    name = "mem"

    def __init__(self, inner: MemStore) -> None:
        self.inner = inner
        self.failed = asyncio.Event()
        self.resume = asyncio.Event()
        self.watches = 0

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return await self.inner.get_prefix(prefix)

    async def list_prefix(self, prefix: str) -> PrefixListing:
        return await self.inner.list_prefix(prefix)

    async def watch_prefix(self, prefix: str, *, after: PrefixListing | None = None) -> AsyncIterator[WatchEvent]:
        self.watches += 1
        if self.watches == 1:
            self.failed.set()
            await self.resume.wait()
            raise DiscoveryError("watch lost")
        async for ev in self.inner.watch_prefix(prefix, after=after):
            yield ev


async def test_failed_watch_is_retried_and_deletes_missed_meanwhile_are_told() -> None:
    inner = MemStore()
    await inner.start()
    await inner.put(key(1), card("a"))
    await inner.put(key(2), card("b"))
    store = FailingOnce(inner)
    cards = ModelCardSet(store, mdc_prefix(NS), retry_s=0.01)  # type: ignore[arg-type]
    seen = Recorder()
    cards.add_listener(seen)
    await cards.start()
    try:
        await asyncio.wait_for(store.failed.wait(), 3)
        await inner.delete(key(1))  # while the watch is down
        store.resume.set()
        await until(lambda: (key(1), None) in seen.events)
        await inner.put(key(3), card("c"))
        await until(lambda: (key(3), "c") in seen.events)
        assert store.watches == 2
        assert set(cards.cards) == {key(2), key(3)}
    finally:
        await cards.close()
        await inner.close()


async def test_listener_dynamo_error_restarts_the_watch_and_puts_the_card_again() -> None:
    store = MemStore()
    await store.start()
    calls: list[str] = []

    def fails_once(k: str, c: ModelCard | None) -> None:
        calls.append(k)
        if k == key(2) and calls.count(k) == 1:
            raise DiscoveryError("endpoint client could not start")

    cards = ModelCardSet(store, mdc_prefix(NS), retry_s=0.01)
    cards.add_listener(fails_once)
    await cards.start()
    try:
        await store.put(key(2), card("b"))
        await until(lambda: calls.count(key(2)) >= 2)
        assert cards.get(key(2)) is not None
    finally:
        await cards.close()
        await store.close()
