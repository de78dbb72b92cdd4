"""``WatchedMap``: the decoded records under one discovery key prefix, kept current by a watch.

Instances, model cards, transfer agents, planner overrides, the supervisor's scaler record and the
console's picture all follow a prefix the same way, so it is done once, here:

* ``start()`` seeds from a listing (``list_prefix``) and tells the listeners in key order before it
  returns, so a caller that awaits it serves with what is there. The watch then starts right after
  that listing (``watch_prefix(after=listing)``): a key deleted between the two reads is reported
  deleted, and nothing seeded is told twice.
* A store restart is handled by the backend's watch (etcd re-lists after lost or compacted history
  and sends the difference). When the watch itself fails with a ``DynamoError`` (a backend error,
  or a listener's: say, a client that could not open for a new record) the map waits ``retry_s``,
  re-lists, tells the difference (removals for keys that vanished, puts for new or changed ones and
  for keys a listener failed on) and watches again from that listing. ``in_sync`` is False between
  the failure and the repair, for callers that must not serve a view they cannot vouch for.
* Optionally (``reconcile_interval_s``) a slow check re-reads the prefix and applies a difference
  seen by two reads in a row: a net under the watch for a change it never delivered, which cannot
  undo a fresh change that one read raced with.
* Each value goes through ``decode(key, raw)``. A value that does not decode is skipped (the last
  good value under its key stays, unless ``drop_invalid``) and reported once per distinct bytes
  (``on_invalid``, or a warning), so one bad writer neither floods the log nor stops the loop.
* Listeners get ``(key, value)`` on every put and ``(key, None)`` when a key is gone; a listener may
  be a coroutine function and is then awaited before the next listener and event, so every
  listener sees the changes in order. A listener that raises anything but a ``DynamoError`` is
  logged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

from dynamod.shared.discovery.store import DiscoveryStore, PrefixListing, WatchEventKind
from dynamod.shared.errors import DynamoError

logger = logging.getLogger(__name__)

V = TypeVar("V")

Decoder = Callable[[str, bytes], V]
"""``decode(key, raw)``: the record, or an exception for a value that is not one."""

Listener = Callable[[str, V | None], Awaitable[None] | None]
"""Called with (key, value) on put and (key, None) on removal; awaited when it returns an awaitable."""

InvalidHandler = Callable[[str, Exception], None]
"""Called once per distinct bad value with its key and the decoder's exception."""

DEFAULT_RETRY_S = 1.0


class WatchedMap(Generic[V]):
    """``key -> decoded record`` for every key under ``prefix`` that ``accepts`` (default: all)."""

    def __init__(
        self,
        store: DiscoveryStore,
        prefix: str,
        decode: Decoder[V],
        *,
        what: str = "record",
        accepts: Callable[[str], bool] | None = None,
        on_invalid: InvalidHandler | None = None,
        drop_invalid: bool = False,
        retry_s: float = DEFAULT_RETRY_S,
        reconcile_interval_s: float | None = None,
    ) -> None:
        self._store = store
        self.prefix = prefix
        self._decode = decode
        self._what = what
        self._accepts = accepts
        self._on_invalid = on_invalid
        self._drop_invalid = drop_invalid
        self._retry_s = retry_s
        self._reconcile_interval_s = reconcile_interval_s
        self._values: dict[str, V] = {}
        self._view: Mapping[str, V] = MappingProxyType(self._values)
        self._raw: dict[str, bytes] = {}  # the bytes each value was decoded from
        self._invalid: dict[str, bytes] = {}  # keys whose latest bytes did not decode (reported once)
        self._unsettled: set[str] = set()  # keys a listener failed on: told again by the next resync
        self._listeners: list[Listener[V]] = []
        self._changed = asyncio.Condition()
        self._writing = asyncio.Lock()  # one change at a time, so async listeners see them in order
        self._starting = asyncio.Lock()  # concurrent start() calls seed and watch once
        self._task: asyncio.Task[None] | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self._suspect_gone: set[str] = set()  # differences the previous reconcile read showed
        self._suspect_new: set[str] = set()
        self.in_sync = True

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Seeds from a listing (listeners are told, in key order) and starts the watch. A
        ``DynamoError`` from the listing (or a listener) is raised: the caller cannot start blind."""
        async with self._starting:
            if self._task is not None:
                return
            listing = await self.load()
            self._task = asyncio.create_task(self._follow(listing), name=f"watched-map:{self.prefix}")
            if self._reconcile_interval_s is not None:
                self._reconciler = asyncio.create_task(
                    self._reconcile_loop(), name=f"watched-map-reconcile:{self.prefix}"
                )

    async def load(self) -> PrefixListing:
        """Reads the prefix once and makes the map match it (listeners are told the difference),
        without watching: ``start()`` is this plus the watch, and a one-shot reader needs no more."""
        listing = await self._store.list_prefix(self.prefix)
        await self._resync(listing)
        return listing

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._reconciler) if t is not None]
        self._task = self._reconciler = None
        for task in tasks:
            task.cancel()
        # gather(return_exceptions=True) absorbs the tasks' own cancellation only: if the caller
        # is cancelled while waiting here, gather raises CancelledError and it propagates.
        await asyncio.gather(*tasks, return_exceptions=True)

    async def ended(self) -> None:
        """Returns when the watch has ended: the store was closed (a failing watch is retried and
        never ends by itself). Cancelling the caller leaves the watch running."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def add_listener(self, listener: Listener[V]) -> None:
        self._listeners.append(listener)

    # -- reading ----------------------------------------------------------------------------------

    @property
    def view(self) -> Mapping[str, V]:
        """The current records by key: a read-only view that follows the watch (the same object
        every time, so a caller may keep it)."""
        return self._view

    def get(self, key: str) -> V | None:
        return self._values.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Returns once ``predicate()`` holds (checked after every change); TimeoutError after
        ``timeout`` seconds."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    # -- writing ----------------------------------------------------------------------------------

    async def apply(self, key: str, raw: bytes | None) -> None:
        """One change as the watch delivers it (``raw`` None: the key is gone). Also for a writer
        that knows of its own change before its watch does (a withdrawn record)."""
        async with self._writing:
            await self._apply(key, raw)
        await self._wake()

    async def reconcile(self, live: Mapping[str, bytes]) -> bool:
        """Applies the keys that ``live`` (a fresh read of the prefix) lacks or adds against this
        view *and* that the previous read showed too; returns whether the view changed."""
        changed = False
        async with self._writing:
            live = {k: v for k, v in live.items() if self._wanted(k) and self._invalid.get(k) != v}
            gone = {k for k in self._values if k not in live}
            new = {k for k in live if k not in self._values}
            for key in sorted(gone & self._suspect_gone):
                logger.info("%s reconciled away (its DELETE was never seen) key=%s", self._what, key)
                await self._apply(key, None)
                changed = True
            for key in sorted(new & self._suspect_new):
                logger.info("%s reconciled in (its PUT was never seen) key=%s", self._what, key)
                await self._apply(key, live[key])
                changed = True
            self._suspect_gone = gone - self._suspect_gone
            self._suspect_new = new - self._suspect_new
        if changed:
            await self._wake()
        return changed

    # -- internals --------------------------------------------------------------------------------

    def _wanted(self, key: str) -> bool:
        return self._accepts is None or self._accepts(key)

    async def _wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _apply(self, key: str, raw: bytes | None) -> None:
        if not self._wanted(key):
            return
        if raw is None:
            self._invalid.pop(key, None)
            await self._remove(key)
            return
        try:
            value = self._decode(key, raw)
        except Exception as exc:  # noqa: BLE001 - any failure to read untrusted bytes skips them
            if self._invalid.get(key) != raw:
                self._invalid[key] = raw
                if self._on_invalid is not None:
                    self._on_invalid(key, exc)
                else:
                    logger.warning("ignoring malformed %s key=%s error=%s", self._what, key, exc)
            if self._drop_invalid:
                await self._remove(key)
            return
        self._invalid.pop(key, None)
        self._values[key] = value
        self._raw[key] = raw
        await self._tell(key, value)

    async def _remove(self, key: str) -> None:
        self._raw.pop(key, None)
        held = key in self._values
        self._values.pop(key, None)
        if held or key in self._unsettled:  # unsettled: a listener failed on its last change
            await self._tell(key, None)

    async def _tell(self, key: str, value: V | None) -> None:
        self._unsettled.add(key)
        for listener in self._listeners:
            try:
                result = listener(key, value)
                if inspect.isawaitable(result):
                    await result
            except DynamoError:
                raise  # the watch restarts and the next resync tells this key again
            except Exception:  # noqa: BLE001 - one listener's bug must not stop the others or the watch
                logger.exception("%s listener failed key=%s", self._what, key)
        self._unsettled.discard(key)

    async def _resync(self, listing: PrefixListing) -> None:
        """Makes the view match ``listing``: removals for keys that vanished, then puts (key order)
        for keys that are new, changed, or that a listener failed on."""
        live = {k: v for k, v in listing.items.items() if self._wanted(k)}
        async with self._writing:
            for key in sorted(self._invalid.keys() - live.keys()):
                del self._invalid[key]
            for key in sorted((self._values.keys() | self._unsettled) - live.keys()):
                await self._apply(key, None)
            for key in sorted(live):
                raw = live[key]
                if key in self._unsettled or (self._raw.get(key) != raw and self._invalid.get(key) != raw):
                    await self._apply(key, raw)
        await self._wake()

    async def _follow(self, listing: PrefixListing | None) -> None:
        """Watches from ``listing``; after a failure re-lists, tells the difference, watches again."""
        while True:
            try:
                if listing is None:
                    listing = await self._store.list_prefix(self.prefix)
                    await self._resync(listing)
                    self.in_sync = True
                    logger.info("%s watch resumed prefix=%s records=%d", self._what, self.prefix, len(self._values))
                async with contextlib.aclosing(self._store.watch_prefix(self.prefix, after=listing)) as events:
                    async for ev in events:
                        await self.apply(ev.key, ev.value if ev.kind is WatchEventKind.PUT else None)
                return  # the store closed
            except DynamoError as exc:
                listing = None
                # One warning per outage; the retries while it lasts are debug lines.
                log = logger.warning if self.in_sync else logger.debug
                self.in_sync = False
                log("%s watch failed prefix=%s error=%s retry_in_s=%.1f", self._what, self.prefix, exc, self._retry_s)
                await asyncio.sleep(self._retry_s)

    async def _reconcile_loop(self) -> None:
        assert self._reconcile_interval_s is not None
        while True:
            await asyncio.sleep(self._reconcile_interval_s)
            try:
                await self.reconcile(await self._store.get_prefix(self.prefix))
            except DynamoError as exc:  # discovery briefly unreachable: the watch resumes by itself
                logger.debug("%s reconcile skipped prefix=%s error=%s", self._what, self.prefix, exc)
