"""WatchedMap on the mem and file backends: seeded from a listing, watched from that listing,
re-listed after a failed watch, bad values skipped and reported once, listeners told in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.discovery.store import DiscoveryStore, PrefixListing, WatchEvent
from dynamod.shared.errors import DiscoveryError
from dynamod.shared.runtime.watched_map import WatchedMap
from tests.unit.runtime.support import until

P = "v1/test/"


def number(_key: str, raw: bytes) -> int:
    return int(raw)  # ValueError for a value that is not a number


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int | None]] = []

    def __call__(self, key: str, value: int | None) -> None:
        self.events.append((key.removeprefix(P), value))


async def test_seed_in_key_order_then_puts_updates_and_deletes(store: DiscoveryStore) -> None:
    await store.put(P + "b", b"2")
    await store.put(P + "a", b"1")
    await store.put("v1/other/x", b"9")
    seen = Recorder()
    m = WatchedMap(store, P, number)
    m.add_listener(seen)
    await m.start()
    try:
        assert seen.events == [("a", 1), ("b", 2)]  # told before start() returned
        await store.put(P + "c", b"3")
        await until(lambda: len(seen.events) == 3)
        await store.put(P + "a", b"10")
        await until(lambda: len(seen.events) == 4)
        await store.delete(P + "b")
        await until(lambda: len(seen.events) == 5)
        assert seen.events[2:] == [("c", 3), ("a", 10), ("b", None)]
        assert dict(m.view) == {P + "a": 10, P + "c": 3}
    finally:
        await m.close()


async def test_a_key_deleted_between_the_listing_and_the_watch_is_told_gone(store: DiscoveryStore) -> None:
    """The watch starts at the listing, not with a snapshot of its own: the key that vanished in
    between is reported removed, and nothing listed is told twice."""
    await store.put(P + "a", b"1")
    await store.put(P + "ghost", b"2")
    real_list = store.list_prefix

    async def list_then_delete(prefix: str) -> PrefixListing:
        listing = await real_list(prefix)
        await store.delete(P + "ghost")  # gone before the watch starts
        return listing

    store.list_prefix = list_then_delete  # type: ignore[method-assign]
    seen = Recorder()
    m = WatchedMap(store, P, number)
    m.add_listener(seen)
    await m.start()
    try:
        await until(lambda: ("ghost", None) in seen.events)
        await store.put(P + "b", b"3")
        await until(lambda: ("b", 3) in seen.events)
        assert seen.events == [("a", 1), ("ghost", 2), ("ghost", None), ("b", 3)]
    finally:
        await m.close()


async def test_bad_values_are_skipped_reported_once_and_never_stop_the_watch(
    store: DiscoveryStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dynamod.shared.runtime.watched_map")
    await store.put(P + "a", b"1")
    seen = Recorder()
    m = WatchedMap(store, P, number, what="counter")
    m.add_listener(seen)
    await m.start()
    try:
        await store.put(P + "a", b"not a number")  # the good value stays
        await store.put(P + "bad", b"nope")
        await store.put(P + "bad", b"nope")  # the same bytes again: not reported again
        await store.put(P + "b", b"2")
        await until(lambda: ("b", 2) in seen.events)
        assert m.get(P + "a") == 1 and P + "bad" not in m
        assert seen.events == [("a", 1), ("b", 2)]
        reports = [r.getMessage() for r in caplog.records if "malformed counter" in r.getMessage()]
        assert len(reports) == 2 and any("key=v1/test/bad" in r for r in reports)
        await store.put(P + "bad", b"3")  # mended
        await until(lambda: m.get(P + "bad") == 3)
    finally:
        await m.close()


async def test_drop_invalid_removes_the_previous_value_and_on_invalid_is_called(store: DiscoveryStore) -> None:
    await store.put(P + "a", b"1")
    invalid: list[str] = []
    seen = Recorder()
    m = WatchedMap(store, P, number, drop_invalid=True, on_invalid=lambda key, exc: invalid.append(key))
    m.add_listener(seen)
    await m.start()
    try:
        await store.put(P + "a", b"garbage")
        await until(lambda: ("a", None) in seen.events)
        assert invalid == [P + "a"] and P + "a" not in m
    finally:
        await m.close()


async def test_accepts_filters_keys_out_entirely(store: DiscoveryStore) -> None:
    await store.put(P + "keep", b"1")
    await store.put(P + "skip", b"not even a number")
    seen = Recorder()
    m = WatchedMap(store, P, number, accepts=lambda key: not key.endswith("skip"))
    m.add_listener(seen)
    await m.start()
    try:
        await store.delete(P + "skip")
        await store.put(P + "other", b"2")
        await until(lambda: ("other", 2) in seen.events)
        assert seen.events == [("keep", 1), ("other", 2)]
    finally:
        await m.close()


async def test_async_listeners_are_awaited_in_order_and_a_buggy_listener_is_skipped(store: DiscoveryStore) -> None:
    order: list[str] = []

    async def slow(key: str, value: int | None) -> None:
        order.append(f"slow-start:{value}")
        await asyncio.sleep(0.01)
        order.append(f"slow-end:{value}")

    def buggy(key: str, value: int | None) -> None:
        raise RuntimeError("listener bug")

    def fast(key: str, value: int | None) -> None:
        order.append(f"fast:{value}")

    m = WatchedMap(store, P, number)
    for listener in (slow, buggy, fast):
        m.add_listener(listener)
    await m.start()
    try:
        await store.put(P + "a", b"1")
        await until(lambda: "fast:1" in order)  # (the file backend's poll may merge quick changes)
        await store.put(P + "a", b"2")
        await until(lambda: "fast:2" in order)
        assert order == ["slow-start:1", "slow-end:1", "fast:1", "slow-start:2", "slow-end:2", "fast:2"]
    finally:
        await m.close()


async def test_concurrent_starts_seed_and_watch_once(store: DiscoveryStore) -> None:
    await store.put(P + "a", b"1")
    seen = Recorder()
    m = WatchedMap(store, P, number)
    m.add_listener(seen)
    await asyncio.gather(m.start(), m.start(), m.start())
    try:
        await store.put(P + "b", b"2")
        await until(lambda: ("b", 2) in seen.events)
        assert seen.events == [("a", 1), ("b", 2)]
    finally:
        await m.close()


class BrokenWatch(MemStore):
    """A mem store whose next watch fails once the test says so, as during an outage."""

    def __init__(self) -> None:
        super().__init__()
        self.break_watch = asyncio.Event()
        self.broken = asyncio.Event()
        self.mend = asyncio.Event()
        self.watches = 0

    async def watch_prefix(  # type: ignore[override]
        self, prefix: str, *, after: PrefixListing | None = None
    ) -> AsyncIterator[WatchEvent]:
        self.watches += 1
        if self.watches == 1:
            await self.break_watch.wait()
            self.broken.set()
            await self.mend.wait()
            raise DiscoveryError("watch lost (injected)")
        async for ev in super().watch_prefix(prefix, after=after):
            yield ev


async def test_a_failed_watch_is_repaired_by_a_listing_that_reports_what_vanished() -> None:
    store = BrokenWatch()
    await store.start()
    for name in ("stays", "goes", "changes"):
        await store.put(P + name, b"1")
    seen = Recorder()
    m = WatchedMap(store, P, number, retry_s=0.01)
    m.add_listener(seen)
    await m.start()
    try:
        assert m.in_sync
        store.break_watch.set()
        await asyncio.wait_for(store.broken.wait(), 3)
        # Changes the broken watch never delivers.
        await store.delete(P + "goes")
        await store.put(P + "changes", b"2")
        await store.put(P + "new", b"3")
        store.mend.set()
        await until(lambda: not m.in_sync)
        await m.wait_for(lambda: m.in_sync, 3)
        assert seen.events[3:] == [("goes", None), ("changes", 2), ("new", 3)]  # "stays" is not told again
        await store.put(P + "after", b"4")  # and the new watch follows on from the listing
        await until(lambda: ("after", 4) in seen.events)
        assert store.watches == 2
    finally:
        await m.close()
        await store.close()


async def test_reconcile_applies_a_difference_only_when_two_reads_show_it(store: DiscoveryStore) -> None:
    m = WatchedMap(store, P, number)
    await m.apply(P + "ghost", b"1")  # a view that believes in a key whose DELETE it never saw
    assert await m.reconcile({P + "missed": b"2"}) is False
    assert await m.reconcile({P + "missed": b"2"}) is True
    assert dict(m.view) == {P + "missed": 2}
    await m.apply(P + "fresh", b"3")
    await m.reconcile({P + "missed": b"2"})  # raced with the fresh put
    await m.reconcile({P + "missed": b"2", P + "fresh": b"3"})
    await m.reconcile({P + "missed": b"2"})
    assert P + "fresh" in m
