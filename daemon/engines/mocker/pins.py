"""Pinned prefix blocks of one rank: which sequence hashes must not be evicted, and until when.

A pin comes from a request's ``cache_control`` (``PreprocessedRequest.pin``): keep the first
blocks of its prompt cached for a TTL. The table only keeps the bookkeeping; the KV manager
enforces it (``kv_manager.py``): in the device pool a pin holds one reference on each of its
blocks, so the allocator never reaches them (the mechanism that protects a running request's
blocks, as SGLang's ``lock_ref``), and the host and disk tiers skip a pinned hash when they push
out their least recently used entry (``tiers.py``).

Bounded: at most ``max_blocks`` hashes are pinned at once (``--max-pinned-fraction`` of the device
cache). A pin whose new blocks would go past that is refused whole: the request still runs, nothing
new is pinned, and the blocks it shares with pins already held are refreshed as a read would.
Pinning a prefix again, or reading pinned blocks (a cache hit), extends their expiry to at least
now + their TTL (Anthropic refreshes a cache entry each time it is used). Expiry is lazy: ``expired``
hands over the hashes whose time has passed, and the KV manager drops their references.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Clock = Callable[[], float]

# ``--max-pinned-fraction``: the share of a rank's device blocks pins may hold at once.
DEFAULT_MAX_PINNED_FRACTION = 0.5


@dataclass(slots=True)
class PinOutcome:
    """What one pin did: ``new`` hashes pinned now (in prefix order), ``refreshed`` hashes that
    were pinned already, ``refused`` when the bound turned the new ones down."""

    new: list[int]
    refreshed: int
    refused: bool = False


class PinTable:
    """Sequence hash -> (expiry, TTL) for one rank, with a min-heap of expiries for lazy expiry."""

    def __init__(self, max_blocks: int, clock: Clock = time.monotonic) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self.clock = clock
        self._pins: dict[int, tuple[float, float]] = {}  # hash -> (expiry, ttl_s)
        self._heap: list[tuple[float, int]] = []  # (expiry, hash); stale entries are skipped
        self.num_created = 0  # blocks pinned since start
        self.num_refused = 0  # pins refused by the bound since start
        self.num_expired = 0  # blocks whose pin ran out since start
        self.num_yielded = 0  # blocks unpinned early so a request that could never fit can run

    def __len__(self) -> int:
        return len(self._pins)

    def __bool__(self) -> bool:
        return bool(self._pins)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._pins

    def hashes(self) -> list[int]:
        return list(self._pins)

    def is_pinned(self, block_hash: int) -> bool:
        """Pinned and not yet expired (an expired pin not collected yet no longer protects)."""
        pin = self._pins.get(block_hash)
        return pin is not None and pin[0] > self.clock()

    def expiry(self, block_hash: int) -> float | None:
        pin = self._pins.get(block_hash)
        return None if pin is None else pin[0]

    def pin(self, hashes: Iterable[int], ttl_s: float) -> PinOutcome:
        """Pins ``hashes`` (a prompt prefix) for ``ttl_s`` seconds from now, or refreshes them."""
        if not ttl_s > 0:
            raise ValueError(f"a pin's TTL must be > 0 seconds, got {ttl_s}")
        now = self.clock()
        pins = self._pins
        held: list[int] = []
        new: list[int] = []
        seen: set[int] = set()
        for h in hashes:
            if h in seen:
                continue
            seen.add(h)
            (held if h in pins else new).append(h)
        for h in held:
            self._extend(h, now, ttl_s)
        if len(pins) + len(new) > self.max_blocks:
            self.num_refused += 1
            return PinOutcome([], len(held), refused=True)
        deadline = now + ttl_s
        for h in new:
            pins[h] = (deadline, ttl_s)
            heapq.heappush(self._heap, (deadline, h))
        self.num_created += len(new)
        return PinOutcome(new, len(held))

    def refresh(self, hashes: Iterable[int]) -> None:
        """A read of these blocks: the pinned ones live another TTL of their own from now."""
        pins = self._pins
        now = self.clock()
        for h in hashes:
            pin = pins.get(h)
            if pin is not None:
                self._extend(h, now, pin[1])

    def _extend(self, h: int, now: float, ttl_s: float) -> None:
        expiry, old_ttl = self._pins[h]
        deadline = now + ttl_s
        if deadline > expiry:
            self._pins[h] = (deadline, max(ttl_s, old_ttl))
            heapq.heappush(self._heap, (deadline, h))

    def expired(self) -> list[int]:
        """Removes and returns the hashes whose pin has run out."""
        heap = self._heap
        if not heap:
            return []
        now = self.clock()
        if heap[0][0] > now:
            return []
        pins = self._pins
        out: list[int] = []
        while heap and heap[0][0] <= now:
            expiry, h = heapq.heappop(heap)
            pin = pins.get(h)
            if pin is not None and pin[0] == expiry:  # not extended since this entry was pushed
                del pins[h]
                out.append(h)
        self.num_expired += len(out)
        return out

    def by_expiry(self) -> list[int]:
        """The pinned hashes, soonest to expire first (the order pins give way in)."""
        return sorted(self._pins, key=lambda h: self._pins[h][0])

    def release(self, hashes: Iterable[int]) -> None:
        """Unpins ``hashes`` before their time (they gave way to a request); the caller drops the
        pin's references."""
        pins = self._pins
        n = 0
        for h in hashes:
            if pins.pop(h, None) is not None:
                n += 1
        self.num_yielded += n

    def clear(self) -> list[int]:
        """Drops every pin (the device cache was cleared); returns the hashes that were pinned."""
        out = list(self._pins)
        self._pins.clear()
        self._heap.clear()
        return out
