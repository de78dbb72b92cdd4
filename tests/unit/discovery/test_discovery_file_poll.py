"""File discovery's watches share one directory scan per poll interval (``file_poll``): many
watches cost one scan, each still sees exactly its prefix's changes, and a watch that starts
after a put never reports that key gone because an older scan landed late."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.discovery.store import WatchEventKind
from tests.fixtures.servers import wait_for


async def _collect(store: FileStore, prefix: str, out: list[tuple[str, str, bytes | None]]) -> None:
    async for ev in store.watch_prefix(prefix):
        out.append((ev.kind.name, ev.key, ev.value))


async def test_many_watches_share_one_scan_and_each_sees_its_prefix(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path), poll_interval_s=0.05)
    await store.start()
    seen: dict[str, list[tuple[str, str, bytes | None]]] = {p: [] for p in ("a/", "b/", "a/x/", "c/")}
    tasks = [asyncio.create_task(_collect(store, p, out)) for p, out in seen.items()]
    try:
        await store.put("a/1", b"one")
        await store.put("a/x/2", b"two")
        await store.put("b/3", b"three")
        await wait_for(lambda: len(seen["a/"]) == 2 and seen["a/x/"] and seen["b/"], 5, "the puts")
        await store.delete("a/1")
        await wait_for(lambda: len(seen["a/"]) == 3, 5, "the delete")
        assert sorted(seen["a/"][:2]) == [("PUT", "a/1", b"one"), ("PUT", "a/x/2", b"two")]
        assert seen["a/"][2] == ("DELETE", "a/1", None)
        assert seen["a/x/"] == [("PUT", "a/x/2", b"two")]
        assert seen["b/"] == [("PUT", "b/3", b"three")]
        assert seen["c/"] == []
        # Four watches, one scan per interval: far fewer scans than four per interval.
        scans_before = store._poll.scans
        await asyncio.sleep(0.5)
        ran = store._poll.scans - scans_before
        assert 2 <= ran <= 12, ran  # ~10 intervals of 50 ms, one scan each (a slow machine runs fewer)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()


async def test_a_late_watch_never_reports_a_present_key_as_gone(tmp_path: Path) -> None:
    """Watches start and stop while the shared poll runs; each new one starts from its own read,
    and no snapshot older than that read may make it report a delete of a key that is there."""
    store = FileStore(str(tmp_path), poll_interval_s=0.01)
    await store.start()
    scan = store._poll._scan

    def late_scan() -> object:  # a listing that lands 50 ms after it was taken: stale on arrival
        snapshot = scan()
        time.sleep(0.05)
        return snapshot

    store._poll._scan = late_scan  # type: ignore[assignment]
    first: list[tuple[str, str, bytes | None]] = []
    keeper = asyncio.create_task(_collect(store, "k/", first))  # keeps the poll running throughout
    try:
        for i in range(8):
            await store.put(f"k/{i}", b"v")
            events: list[tuple[str, str, bytes | None]] = []
            task = asyncio.create_task(_collect(store, "k/", events))
            await wait_for(lambda n=i, ev=events: len(ev) >= n + 1, 5, "the new watch's initial view")
            await asyncio.sleep(0.12)  # a few shared scans land, the first of them stale
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert all(kind == WatchEventKind.PUT.name for kind, _, _ in events), events
            assert {k for _, k, _ in events} == {f"k/{j}" for j in range(i + 1)}
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await store.close()


async def test_watches_end_when_the_store_closes(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path), poll_interval_s=0.05)
    await store.start()
    out: list[tuple[str, str, bytes | None]] = []
    task = asyncio.create_task(_collect(store, "", out))
    await asyncio.sleep(0.1)
    await store.close()
    await asyncio.wait_for(task, 2)  # ended on its own, no cancellation needed
