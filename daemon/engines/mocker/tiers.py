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

Pinned prefixes (``pins.py``): a tier never pushes out a hash that is pinned while an unpinned
entry is left to push out instead (``LruTier.insert`` skips pinned entries, moving them to the
recent end); when every entry is pinned it pushes out the least recently used one anyway, so a tier
smaller than the pinned set still works as an LRU. Pins live in the device pool as held references,
so a pinned hash reaches a lower tier only as the copy an onboard left behind (or after its pin
expired); that copy then stays until the pin ends.

Block bytes: a core that keeps its KV as bytes (``read_row``/``write_row`` given) moves them: the
host tier keeps a copy of each block, the disk tier one file per block (``disk_tier.py``).
Without bytes (the trace replayer) the tiers keep only the index and the timing.

The disk tier's files are written and read on a background thread (``disk_io.py``), never in the
step. The index changes at once, so capacity and LRU order are exact at every step; the bytes
follow. A disk entry whose ``data`` is still set is *being written*: its file is not readable yet,
and an onboard takes those bytes from memory instead (once the write is polled, ``data`` is
dropped and the file is the copy). A disk entry without ``data`` is read from its file first: the
scheduler starts the reads (``start_reads``) and keeps the request waiting, off the running batch,
until ``poll`` hands the bytes over; the other requests keep stepping. A full I/O queue refuses
work rather than block the step: a refused write leaves the block out of the disk tier, a refused
read leaves the rest of the prefix to be recomputed. A failed write or read drops the block from
the tier (``KvRemoved(DISK)``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dynamod.daemon.engines.mocker.block_pool import KVBlock
from dynamod.daemon.engines.mocker.disk_io import READ, WRITE, DiskIo
from dynamod.daemon.engines.mocker.disk_tier import DiskStore
from dynamod.daemon.engines.mocker.tier_entry import TierEntry
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
PinnedPredicate = Callable[[int], bool]


class LruTier:
    """One tier's index: block hash -> entry, least recently used first, at most ``capacity``."""

    def __init__(self, medium: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{medium} tier capacity must be >= 0, got {capacity}")
        self.medium = medium
        self.capacity = capacity
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()
        self.is_pinned: PinnedPredicate | None = None  # pinned hashes are pushed out last

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
        pinned = self.is_pinned
        while len(entries) > self.capacity:
            if pinned is not None:
                # Pinned entries at the LRU end move to the recent end; at most one pass.
                for _ in range(len(entries) - 1):
                    oldest = next(iter(entries))
                    if not pinned(oldest):
                        break
                    entries.move_to_end(oldest)
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
    disk_writes_refused: int = 0  # offloads the disk tier skipped because its I/O queue was full
    disk_io_failures: int = 0  # block files that could not be written or read (the block was dropped)
    onboard_ms: float = 0.0
    onboard_bytes: int = 0
    offload_bytes: int = 0


@dataclass(slots=True)
class OnboardPlan:
    """Blocks ``start .. start + len(entries)`` of a request, found in lower tiers."""

    start: int
    entries: list[TierEntry]
    media: list[str]

    def head(self, n: int) -> OnboardPlan | None:
        """The plan's first ``n`` blocks (None for none)."""
        if n <= 0:
            return None
        if n >= len(self.entries):
            return self
        return OnboardPlan(self.start, self.entries[:n], self.media[:n])



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
        disk_io_queue_blocks: int = 64,
        io_thread_name: str = "dynamod-kv-disk",
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
        self._reading: set[int] = set()  # disk blocks whose file is being read
        self.io: DiskIo | None = None
        if disk_store is not None:
            for entry in disk_store.load_existing(num_disk_blocks):
                self.disk.insert(entry)
            if self.disk.entries:
                # Blocks a previous run left on disk (persistence): announce them to the router.
                self._events.extend(_stored_runs(self.disk.entries.values(), MEDIUM_DISK))
            self.io = DiskIo(disk_store, max_pending=disk_io_queue_blocks, name=io_thread_name)

    @property
    def keeps_bytes(self) -> bool:
        return self.read_row is not None

    def set_pinned(self, is_pinned: PinnedPredicate | None) -> None:
        """Makes both tiers push pinned hashes out last (the device pool's pin table)."""
        self.host.is_pinned = is_pinned
        self.disk.is_pinned = is_pinned

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
        flush = _TierFlush(host, entries)  # a block already there stayed when it was onboarded
        self.stats.offloaded[MEDIUM_CPU] += len(flush.stored)
        self.stats.offload_bytes += len(flush.stored) * self.block_bytes
        flush.queue_events(self._events)
        if flush.pushed and self.disk.capacity:
            self._into_disk(flush.pushed)

    def _into_disk(self, entries: list[TierEntry]) -> None:
        disk = self.disk
        io = self.io
        stats = self.stats
        flush = _TierFlush(disk, entries)
        kept = flush.kept()
        if io is not None:
            stored_ids = {id(e) for e in flush.stored}
            for entry in flush.pushed:
                if id(entry) not in stored_ids:
                    io.delete(entry.block_hash)  # its file, or its write still queued
            # Only blocks still in the tier after this flush get a file (one stored and pushed out
            # within it never does); deletes go first, so a hash written anew keeps its new file.
            # Each keeps its bytes until its write is polled: onboards read them meanwhile. A write
            # the full queue refuses leaves its block out of the tier.
            refused = [e for e in kept if e.data is not None and not io.try_write(e, e.data)]
            for entry in refused:
                disk.pop(entry.block_hash)
                entry.data = None
            stats.disk_writes_refused += len(refused)
            offloaded = len(flush.stored) - len(refused)
        else:
            for entry in kept:
                entry.data = None  # no files: the tier keeps the index only
            offloaded = len(flush.stored)
        for entry in flush.pushed:
            entry.data = None
        stats.offloaded[MEDIUM_DISK] += offloaded
        stats.offload_bytes += offloaded * self.block_bytes
        stats.evicted_disk += len(flush.pushed)
        flush.queue_events(self._events)

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

    def first_unread(self, plan: OnboardPlan, staged: dict[int, np.ndarray] | None) -> int:
        """How many leading blocks of ``plan`` can be onboarded now: up to the first disk block
        whose bytes are neither in memory (a write in flight) nor in ``staged`` (read for the
        request). Without files (no bytes kept) every block can."""
        if self.io is None:
            return len(plan.entries)
        for i, (entry, medium) in enumerate(zip(plan.entries, plan.media, strict=True)):
            if medium == MEDIUM_DISK and entry.data is None and (staged is None or entry.block_hash not in staged):
                return i
        return len(plan.entries)

    def start_reads(self, plan: OnboardPlan, staged: dict[int, np.ndarray]) -> list[int]:
        """Starts reading the files of the plan's disk blocks that have no bytes in memory, joining
        reads already in flight; returns the hashes being read, in order. Stops at the first read
        the full I/O queue refuses (the blocks after it would not be used). Disk blocks whose write
        is still in flight put their bytes in ``staged`` now: by the time the reads end their write
        may be done and the bytes dropped. Reading is a use: the blocks read become the tier's most
        recent."""
        io = self.io
        assert io is not None
        out: list[int] = []
        reading = self._reading
        for entry, medium in zip(plan.entries, plan.media, strict=True):
            if medium != MEDIUM_DISK:
                continue
            h = entry.block_hash
            if entry.data is not None:
                staged[h] = entry.data
                continue
            if h not in reading:
                if not io.try_read(h):
                    break
                reading.add(h)
            self.disk.touch(h)
            out.append(h)
        return out

    def poll(self) -> dict[int, np.ndarray | None]:
        """Applies the disk I/O that finished since the last poll; returns the reads that ended
        (block hash -> bytes, or None when the file was unusable and the block was dropped)."""
        io = self.io
        if io is None:
            return {}
        reads: dict[int, np.ndarray | None] = {}
        disk = self.disk
        lost: list[int] = []
        for done in io.poll():
            h = done.block_hash
            entry = disk.get(h)
            if done.kind == WRITE:
                if entry is None or entry is not done.entry:
                    continue  # it left the tier meanwhile (its delete is queued behind the write)
                if done.error is None:
                    entry.data = None  # the file is the copy now
                    continue
            elif done.kind == READ:
                self._reading.discard(h)
                if done.error is None:
                    reads[h] = done.data
                    continue
                reads[h] = None
                if entry is None or entry.data is not None:
                    continue  # gone already, or re-offloaded with its bytes since
            # A write or read failed: the block is not in this tier any more.
            self.stats.disk_io_failures += 1
            disk.pop(h)
            io.delete(h)
            lost.append(h)
        if lost:
            self._events.append(KvRemoved(block_hashes=lost, medium=MEDIUM_DISK))
        return reads

    @property
    def io_pending(self) -> int:
        """Disk reads and writes submitted and not yet polled."""
        return self.io.pending if self.io is not None else 0

    def wait_io(self, timeout: float) -> bool:
        """Blocks until some disk I/O finished (or none is in flight); False on timeout. For
        synchronous drivers; the engine's step loop is woken by the I/O listener instead."""
        return self.io.wait(timeout) if self.io is not None else True

    def onboard(self, plan: OnboardPlan, blocks: list[KVBlock], staged: dict[int, np.ndarray] | None = None) -> float:
        """Copies the plan's blocks into ``blocks`` (fresh device blocks, one per entry); returns
        the time it takes (ms): host blocks at the h2d bandwidth, disk blocks read first. A disk
        block's bytes come from memory (its write is in flight) or from ``staged`` (its file was
        read for the request: ``first_unread`` says how far a plan can go)."""
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
                data = entry.data
                if data is None and staged is not None:
                    data = staged.get(entry.block_hash)
            if write is not None:
                if data is not None:
                    write(block.block_id, data)
                elif self.io is not None:  # the scheduler cuts a plan at its first unread block
                    raise RuntimeError(f"{medium} block {entry.block_hash:x} has no bytes to onboard")
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
            if self.io is not None:
                for entry in entries:
                    self.io.delete(entry.block_hash)  # its file, or its write still queued
                    entry.data = None
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
        """Ends the disk tier. A persistent one first finishes its queued writes, so the files
        are what its index says; otherwise queued writes are dropped and the files removed."""
        store = self.disk_store
        if store is None:
            return
        if self.io is not None:
            self.io.close(flush=store.persist)
        store.close()


class _TierFlush:
    """Offloads entering one tier in one flush: what was stored, what was pushed out (LRU first),
    and, per block hash, whether the tier held it before the flush. The router tracks hashes, so
    the events are the net change per hash (``queue_events``): a hash pushed out and stored again
    within one flush (the same block offloaded again) is no event at all, not a duplicate store
    followed by a removal that would leave the router without a block the tier holds."""

    __slots__ = ("tier", "stored", "pushed", "held_before")

    def __init__(self, tier: LruTier, entries: list[TierEntry]) -> None:
        self.tier = tier
        self.stored: list[TierEntry] = []
        self.pushed: list[TierEntry] = []
        held_before: dict[int, bool] = {}  # first sight of a hash in this flush
        for entry in entries:
            h = entry.block_hash
            if h in tier:
                tier.touch(h)
                continue
            held_before.setdefault(h, False)  # absent now, and not pushed out earlier in this flush
            self.stored.append(entry)
            for out in tier.insert(entry):
                held_before.setdefault(out.block_hash, True)  # held, and not stored in this flush
                self.pushed.append(out)
        self.held_before = held_before

    def kept(self) -> list[TierEntry]:
        """The stored entries still in the tier, in insertion order."""
        entries = self.tier.entries
        return [e for e in self.stored if entries.get(e.block_hash) is e]

    def queue_events(self, events: list[KvEvent]) -> None:
        """The tier's net change as events (call after any later removal from the tier)."""
        tier, held_before = self.tier, self.held_before
        new = [e for e in self.kept() if not held_before[e.block_hash]]
        gone = [h for h, held in held_before.items() if held and h not in tier]
        if gone:
            events.append(KvRemoved(block_hashes=gone, medium=tier.medium))
        if new:
            events.extend(_stored_runs(new, tier.medium))


def _parent_first(entries: Iterable[TierEntry]) -> list[TierEntry]:
    """``entries`` reordered so that each comes after its parent when the parent is among them,
    chains kept together. Evictions arrive child first (a request frees its blocks tail first), but
    a router looks a stored block's parent up in the tiers it already knows: the device has just
    dropped it (``KvRemoved(GPU)`` comes first), so the parent must already be stored here."""
    entries = list(entries)
    by_hash = {e.block_hash: e for e in entries}
    children: dict[int, list[TierEntry]] = {}
    roots: list[TierEntry] = []
    for entry in entries:
        parent = entry.parent_hash
        if parent is not None and parent in by_hash and parent != entry.block_hash:
            children.setdefault(parent, []).append(entry)
        else:
            roots.append(entry)
    out: list[TierEntry] = []
    stack = list(reversed(roots))
    while stack:
        entry = stack.pop()
        out.append(entry)
        stack.extend(reversed(children.get(entry.block_hash, ())))
    return out


def _stored_runs(entries: Iterable[TierEntry], medium: str) -> Iterator[KvStored]:
    """One ``KvStored`` per run of entries where each is the previous one's child, parents first."""
    run: list[TierEntry] = []
    for entry in _parent_first(entries):
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
