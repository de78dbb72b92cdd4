"""The lower KV tiers behind a mocker's device cache: host memory, then disk.

A block the device pool evicts is not lost: it goes to the host tier (pinned CPU memory in a real
engine), and a block the host tier evicts goes to the disk tier; each tier is an LRU of fixed
capacity. A prompt whose prefix continues in a lower tier *onboards* those blocks (copies them back
into fresh device blocks) instead of recomputing them, paying ``bytes / bandwidth`` instead of
prefill compute. That is vLLM's CPU offloading connector and LMCache's disk backend in miniature.

Events follow the wire contract (``shared/protocol/kv_events.py``): an offload from device to host
is ``KvRemoved(GPU)`` (the pool queues it) + ``KvStored(CPU)``; host to disk ``KvRemoved(CPU)`` +
``KvStored(DISK)``; a block leaving the disk tier ``KvRemoved(DISK)``. Onboarding caches the
device copy (``KvStored(GPU)``, queued by the pool) and leaves the lower copy where it is.

Offloads are collected while the scheduler allocates (``on_evict``, the pool's eviction hook) and
applied to the tiers once the step's admissions are done (``flush``): a lookup made before an
allocation thus still finds every block it planned to onboard after that allocation evicted others.
Offload copies are asynchronous in a real engine (they overlap compute), so only onboarding costs
step time here.

Block bytes: a core that keeps its KV as bytes (``read_row``/``write_row`` given) moves them: the
host tier keeps a copy of each block, the disk tier one file per block (``disk_tier.py``).
Without bytes (the trace replayer) the tiers keep only the index and the timing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dynamod.daemon.engines.mocker.block_pool import KVBlock
from dynamod.daemon.engines.mocker.disk_tier import DiskStore
from dynamod.shared.protocol.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    KvEvent,
    KvRemoved,
    KvStored,
    StoredBlock,
)

RowReader = Callable[[int], np.ndarray]
RowWriter = Callable[[int, np.ndarray], None]


class TierEntry:
    """One block in a lower tier: its identity (for events and lookups) and, in the host tier of a
    core that keeps bytes, a copy of its contents."""

    __slots__ = ("block_hash", "tokens_hash", "parent_hash", "lora_name", "data")

    def __init__(
        self, block_hash: int, tokens_hash: int, parent_hash: int | None, lora_name: str | None,
        data: np.ndarray | None = None,
    ) -> None:
        self.block_hash = block_hash
        self.tokens_hash = tokens_hash
        self.parent_hash = parent_hash
        self.lora_name = lora_name
        self.data = data

    def __repr__(self) -> str:
        return f"TierEntry(hash={self.block_hash})"


class LruTier:
    """One tier's index: block hash -> entry, least recently used first, at most ``capacity``."""

    def __init__(self, medium: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{medium} tier capacity must be >= 0, got {capacity}")
        self.medium = medium
        self.capacity = capacity
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    @property
    def usage(self) -> float:
        return len(self.entries) / self.capacity if self.capacity else 0.0

    def get(self, block_hash: int) -> TierEntry | None:
        return self.entries.get(block_hash)

    def touch(self, block_hash: int) -> None:
        self.entries.move_to_end(block_hash)

    def insert(self, entry: TierEntry) -> list[TierEntry]:
        """Adds ``entry`` as most recently used; returns the entries pushed out (LRU first)."""
        entries = self.entries
        entries[entry.block_hash] = entry
        evicted: list[TierEntry] = []
        while len(entries) > self.capacity:
            evicted.append(entries.popitem(last=False)[1])
        return evicted

    def pop(self, block_hash: int) -> TierEntry | None:
        return self.entries.pop(block_hash, None)

    def clear(self) -> list[TierEntry]:
        out = list(self.entries.values())
        self.entries.clear()
        return out


@dataclass(slots=True)
class TierBandwidth:
    """Decimal GB/s per direction; 0 means unlimited (no time charged), as Dynamo's flags."""

    d2h_gbps: float = 0.0  # device -> host (offload)
    h2d_gbps: float = 0.0  # host -> device (onboard)
    disk_write_gbps: float = 0.0  # host -> disk (offload)
    disk_read_gbps: float = 0.0  # disk -> host (onboard, then h2d)


def transfer_ms(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e6) if gbps > 0 else 0.0  # bytes / (GB/s * 1e9) * 1e3


@dataclass(slots=True)
class TierStats:
    """Cumulative counters since start, per lower tier (blocks)."""

    offloaded: dict[str, int] = field(default_factory=lambda: {MEDIUM_CPU: 0, MEDIUM_DISK: 0})
    onboarded: dict[str, int] = field(default_factory=lambda: {MEDIUM_CPU: 0, MEDIUM_DISK: 0})
    evicted_disk: int = 0  # blocks dropped off the bottom of the last tier
    onboard_ms: float = 0.0
    onboard_bytes: int = 0
    offload_bytes: int = 0


@dataclass(slots=True)
class OnboardPlan:
    """Blocks ``start .. start + len(entries)`` of a request, found in lower tiers."""

    start: int
    entries: list[TierEntry]
    media: list[str]


class TieredKvCache:
    """The host and disk tiers of one data-parallel rank, fed by the device pool's evictions."""

    def __init__(
        self,
        *,
        num_host_blocks: int,
        num_disk_blocks: int,
        block_bytes: int,
        bandwidth: TierBandwidth,
        disk_store: DiskStore | None = None,
        read_row: RowReader | None = None,
        write_row: RowWriter | None = None,
    ) -> None:
        self.host = LruTier(MEDIUM_CPU, num_host_blocks)
        self.disk = LruTier(MEDIUM_DISK, num_disk_blocks)
        self.block_bytes = block_bytes
        self.bandwidth = bandwidth
        self.disk_store = disk_store
        self.read_row = read_row
        self.write_row = write_row
        self.stats = TierStats()
        self._pending: list[TierEntry] = []
        self._events: list[KvEvent] = []
        if disk_store is not None:
            for entry in disk_store.load_existing(num_disk_blocks):
                self.disk.insert(entry)
            if self.disk.entries:
                # Blocks a previous run left on disk (persistence): announce them to the router.
                self._events.extend(_stored_runs(self.disk.entries.values(), MEDIUM_DISK))

    @property
    def keeps_bytes(self) -> bool:
        return self.read_row is not None

    @property
    def tiers(self) -> tuple[LruTier, ...]:
        return tuple(t for t in (self.host, self.disk) if t.capacity)

    # ---- offload ---------------------------------------------------------------------------------

    def on_evict(self, blocks: list[KVBlock]) -> None:
        """The pool's eviction hook: ``blocks`` still carry their hashes (and, with bytes, their
        rows still hold their contents, copied now before the new owner overwrites them)."""
        read = self.read_row
        pending = self._pending
        for block in blocks:
            data = read(block.block_id).copy() if read is not None else None
            pending.append(TierEntry(block.block_hash, block.tokens_hash, block.parent_hash,  # type: ignore[arg-type]
                                     block.lora_name, data))

    def flush(self) -> None:
        """Applies the collected offloads to the tiers, queueing their events."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self.host.capacity:
            self._into_host(pending)
        elif self.disk.capacity:
            self._into_disk(pending)

    def _into_host(self, entries: list[TierEntry]) -> None:
        host = self.host
        stored: list[TierEntry] = []
        pushed: list[TierEntry] = []
        for entry in entries:
            if entry.block_hash in host:
                host.touch(entry.block_hash)  # the host copy stayed when it was onboarded
                continue
            stored.append(entry)
            pushed.extend(host.insert(entry))
        self.stats.offloaded[MEDIUM_CPU] += len(stored)
        self.stats.offload_bytes += len(stored) * self.block_bytes
        # An entry stored and pushed out within one flush was never announced: skip both events.
        pushed_ids = {id(e) for e in pushed}
        announced = [e for e in stored if id(e) not in pushed_ids]
        stored_ids = {id(e) for e in stored}
        left = [e for e in pushed if id(e) not in stored_ids]
        if announced:
            self._events.extend(_stored_runs(announced, MEDIUM_CPU))
        if left:
            self._events.append(KvRemoved(block_hashes=[e.block_hash for e in left], medium=MEDIUM_CPU))
        if pushed and self.disk.capacity:
            self._into_disk(pushed)

    def _into_disk(self, entries: list[TierEntry]) -> None:
        disk = self.disk
        store = self.disk_store
        stored: list[TierEntry] = []
        dropped: list[TierEntry] = []
        for entry in entries:
            if entry.block_hash in disk:
                disk.touch(entry.block_hash)
                continue
            if store is not None and entry.data is not None:
                store.write(entry, entry.data)
            entry.data = None  # the disk copy is the file
            stored.append(entry)
            dropped.extend(disk.insert(entry))
        self.stats.offloaded[MEDIUM_DISK] += len(stored)
        self.stats.offload_bytes += len(stored) * self.block_bytes
        dropped_ids = {id(e) for e in dropped}
        announced = [e for e in stored if id(e) not in dropped_ids]
        stored_ids = {id(e) for e in stored}
        left = [e for e in dropped if id(e) not in stored_ids]
        if store is not None:
            for entry in dropped:
                store.delete(entry.block_hash)
        self.stats.evicted_disk += len(dropped)
        if announced:
            self._events.extend(_stored_runs(announced, MEDIUM_DISK))
        if left:
            self._events.append(KvRemoved(block_hashes=[e.block_hash for e in left], medium=MEDIUM_DISK))

    # ---- onboard ---------------------------------------------------------------------------------

    def find(self, block_hashes: list[int], start: int, end: int) -> OnboardPlan | None:
        """The run of blocks ``start..`` (before ``end``) that lower tiers hold, or None."""
        host, disk = self.host.entries, self.disk.entries
        entries: list[TierEntry] = []
        media: list[str] = []
        for i in range(start, end):
            h = block_hashes[i]
            entry = host.get(h)
            if entry is not None:
                media.append(MEDIUM_CPU)
            else:
                entry = disk.get(h)
                if entry is None:
                    break
                media.append(MEDIUM_DISK)
            entries.append(entry)
        if not entries:
            return None
        return OnboardPlan(start, entries, media)

    def onboard(self, plan: OnboardPlan, blocks: list[KVBlock]) -> float:
        """Copies the plan's blocks into ``blocks`` (fresh device blocks, one per entry); returns
        the time it takes (ms): host blocks at the h2d bandwidth, disk blocks read first."""
        nbytes = self.block_bytes
        bw = self.bandwidth
        write = self.write_row
        host_n = disk_n = 0
        for entry, medium, block in zip(plan.entries, plan.media, blocks, strict=True):
            if medium == MEDIUM_CPU:
                self.host.touch(entry.block_hash)
                host_n += 1
                data = entry.data
            else:
                self.disk.touch(entry.block_hash)
                disk_n += 1
                data = self.disk_store.read(entry.block_hash) if self.disk_store is not None else None
            if write is not None and data is not None:
                write(block.block_id, data)
        total = host_n + disk_n
        ms = transfer_ms(total * nbytes, bw.h2d_gbps) + transfer_ms(disk_n * nbytes, bw.disk_read_gbps)
        stats = self.stats
        stats.onboarded[MEDIUM_CPU] += host_n
        stats.onboarded[MEDIUM_DISK] += disk_n
        stats.onboard_bytes += total * nbytes
        stats.onboard_ms += ms
        return ms

    # ---- control ---------------------------------------------------------------------------------

    def clear(self, medium: str | None) -> int:
        """Empties one lower tier (``MEDIUM_CPU``/``MEDIUM_DISK``) or both (None); returns how many
        blocks it dropped. The caller queues the ``KvCleared`` event."""
        self.flush()
        dropped = 0
        if medium in (None, MEDIUM_CPU):
            dropped += len(self.host.clear())
        if medium in (None, MEDIUM_DISK):
            entries = self.disk.clear()
            if self.disk_store is not None:
                for entry in entries:
                    self.disk_store.delete(entry.block_hash)
            dropped += len(entries)
        return dropped

    def dump(self) -> list[KvStored]:
        """Every lower-tier block as stored events with its medium (for ``kv_dump``)."""
        self.flush()
        out: list[KvStored] = []
        for tier in (self.host, self.disk):
            out.extend(_stored_runs(tier.entries.values(), tier.medium))
        return out

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Ends the disk tier (it removes its files unless they are to persist)."""
        if self.disk_store is not None:
            self.disk_store.close()


def _stored_runs(entries: Iterable[TierEntry], medium: str) -> Iterator[KvStored]:
    """One ``KvStored`` per run of entries where each is the previous one's child."""
    run: list[TierEntry] = []
    for entry in entries:
        if run and (entry.parent_hash != run[-1].block_hash or entry.lora_name != run[0].lora_name):
            yield _stored(run, medium)
            run = []
        run.append(entry)
    if run:
        yield _stored(run, medium)


def _stored(run: list[TierEntry], medium: str) -> KvStored:
    return KvStored(
        parent_hash=run[0].parent_hash,
        blocks=[StoredBlock(e.block_hash, e.tokens_hash) for e in run],
        lora_name=run[0].lora_name,
        medium=medium,
    )
