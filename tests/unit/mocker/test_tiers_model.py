"""A model-based test of the mocker's KV tiers: random sequences of requests (device hits, onboards
from host and disk, recompute), frees, clears of one tier or all, I/O settling and restarts of a
persistent disk tier, run against the real block pool + host/disk tiers + block files, and checked
after every step against a small reference model (dicts and LRU lists).

What is checked: each tier's contents and LRU order, capacities, the device free list's order,
that the KV events replayed by a router give exactly the tiers' contents (every store new, every
removal of something held, each with its medium), that onboarded bytes are the bytes that were
offloaded, and that the disk tier's files match its index once the I/O has settled.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dynamod.daemon.engines.mocker.disk_tier import DiskStore
from dynamod.daemon.engines.mocker.kv_manager import KVCacheManager
from dynamod.daemon.engines.mocker.tiers import TierBandwidth, TieredKvCache
from dynamod.shared.protocol.kv_events import (
    MEDIA,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    KvCleared,
    KvRemoved,
    KvStored,
)

GPU_BLOCKS, HOST_BLOCKS, DISK_BLOCKS = 6, 2, 5
BLOCK_BYTES = 32
IO_TIMEOUT = 10.0


def content(block_hash: int) -> np.ndarray:
    """The bytes a block with this hash holds (unique per hash, so a mix-up shows)."""
    return np.frombuffer(block_hash.to_bytes(8, "little") * (BLOCK_BYTES // 8), dtype=np.uint8)


class Model:
    """What the tiers should hold. Device blocks are keyed by their hash while cached and by an
    ``("anon", n)`` key once a clear made them anonymous; ``refs`` counts requests holding each."""

    def __init__(self, disk: list[int] | None = None) -> None:
        self.refs: dict[object, int] = {}
        self.cached: set[int] = set()  # device prefix cache (held or free)
        self.free_lru: OrderedDict[int, None] = OrderedDict()  # free cached blocks, next evicted first
        self.num_free_empty = GPU_BLOCKS
        self.host: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.disk: OrderedDict[int, None] = OrderedDict.fromkeys(disk or ())
        self.offloads: list[int] = []  # evicted from the device, not yet applied to the tiers
        self._anon = 0

    @property
    def num_free(self) -> int:
        return self.num_free_empty + len(self.free_lru)

    def hits(self, chain: list[int]) -> int:
        n = 0
        while n < len(chain) and chain[n] in self.cached:
            n += 1
        return n

    def plan(self, chain: list[int], start: int) -> list[str]:
        media = []
        for h in chain[start:]:
            if h in self.host:
                media.append(MEDIUM_CPU)
            elif h in self.disk:
                media.append(MEDIUM_DISK)
            else:
                break
        return media

    def onboard(self, chain: list[int], media: list[str]) -> None:
        """An onboard is a use of each block in its lower tier (the copy stays there)."""
        for h, medium in zip(chain, media, strict=False):
            (self.host if medium == MEDIUM_CPU else self.disk).move_to_end(h)

    def touch(self, keys: list[int]) -> None:
        for key in keys:
            if self.refs.get(key, 0) == 0:
                del self.free_lru[key]
            self.refs[key] = self.refs.get(key, 0) + 1

    def allocate(self, n: int) -> list[object]:
        """``n`` fresh anonymous blocks: empty ones first, then the least recently freed cached
        ones, whose hashes go to the offload list."""
        out: list[object] = []
        for _ in range(n):
            if self.num_free_empty:
                self.num_free_empty -= 1
            else:
                h, _ = self.free_lru.popitem(last=False)
                self.cached.discard(h)
                self.offloads.append(h)
            out.append(self._new_anon())
        for key in out:
            self.refs[key] = 1
        return out

    def cache(self, key: object, h: int) -> object:
        """Names a fresh block by its hash, unless another block has it already."""
        if h in self.cached:
            return key
        self.refs[h] = self.refs.pop(key)
        self.cached.add(h)
        return h

    def free(self, keys: list[object]) -> None:
        for key in reversed(keys):
            self.refs[key] -= 1
            if self.refs[key] == 0:
                del self.refs[key]
                if isinstance(key, int):
                    self.free_lru[key] = None
                else:
                    self.num_free_empty += 1

    def flush(self) -> None:
        """Applies the device's evictions: to the host tier, its overflow to disk, off the end."""
        offloads, self.offloads = self.offloads, []
        if HOST_BLOCKS:
            pushed = _into(self.host, offloads, HOST_BLOCKS)
        else:
            pushed = offloads
        if DISK_BLOCKS:
            _into(self.disk, pushed, DISK_BLOCKS)

    def clear(self, medium: str | None, held: list[list[object]]) -> None:
        if medium in (None, MEDIUM_GPU):
            renamed = {h: self._new_anon() for h in self.cached if h in self.refs}
            for keys in held:
                keys[:] = [renamed.get(k, k) if isinstance(k, int) else k for k in keys]
            for h, key in renamed.items():
                self.refs[key] = self.refs.pop(h)
            self.num_free_empty += len(self.free_lru)
            self.free_lru.clear()
            self.cached.clear()
        if medium in (None, MEDIUM_CPU):
            self.host.clear()
        if medium in (None, MEDIUM_DISK):
            self.disk.clear()

    def _new_anon(self) -> object:
        self._anon += 1
        return ("anon", self._anon)


def _into(tier: OrderedDict[int, None], hashes: list[int], capacity: int) -> list[int]:
    pushed = []
    for h in hashes:
        if h in tier:
            tier.move_to_end(h)
            continue
        tier[h] = None
        while len(tier) > capacity:
            pushed.append(tier.popitem(last=False)[0])
    return pushed


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="dynamod-tiers-model-"))
        self.model = Model()
        self.chains: list[list[int]] = []
        self.held: list[tuple[list[object], list]] = []  # (model keys, real blocks) per request
        self.next_hash = 1
        self._open()

    def _open(self) -> None:
        self.kv = KVCacheManager(GPU_BLOCKS, 4)
        self.rows = np.zeros((GPU_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        rows = self.rows

        def read_row(block_id: int) -> np.ndarray:
            return rows[block_id]

        def write_row(block_id: int, data: np.ndarray) -> None:
            rows[block_id] = data

        self.store = DiskStore(self.root / "disk", BLOCK_BYTES, persist=True)
        self.tiers = TieredKvCache(
            num_host_blocks=HOST_BLOCKS, num_disk_blocks=DISK_BLOCKS, block_bytes=BLOCK_BYTES,
            bandwidth=TierBandwidth(), disk_store=self.store, read_row=read_row, write_row=write_row,
            disk_io_queue_blocks=1000,  # never full here: refusals are the unit tests' business
        )
        self.kv.attach_tiers(self.tiers)
        self.view: dict[str, set[int]] = {m: set() for m in MEDIA}  # what a router learns from events
        self._take_events()

    def teardown(self) -> None:
        self.tiers.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- events -----------------------------------------------------------------------------------

    def _take_events(self) -> None:
        view = self.view
        for kv_event in self.kv.take_events():
            medium = kv_event.medium
            if isinstance(kv_event, KvStored):
                for block in kv_event.blocks:
                    assert block.block_hash not in view[medium], f"stored twice in {medium}"
                    view[medium].add(block.block_hash)
            elif isinstance(kv_event, KvRemoved):
                for h in kv_event.block_hashes:
                    assert h in view[medium], f"removed from {medium} but never stored there"
                    view[medium].discard(h)
            elif isinstance(kv_event, KvCleared):
                for cleared in MEDIA if medium is None else (medium,):
                    view[cleared].clear()

    # ---- rules ------------------------------------------------------------------------------------

    @rule(pick=st.integers(0, 1 << 16), keep=st.integers(1, 5), extra=st.integers(0, 2))
    def request(self, pick: int, keep: int, extra: int) -> None:
        """A request for a chain of blocks: a prefix of an earlier chain, then new blocks. Device
        hits are referenced, lower-tier blocks onboarded, the rest computed."""
        # A recent chain: older ones have mostly left every tier of so small a cache.
        base = self.chains[-1 - pick % min(len(self.chains), 8)][:keep] if self.chains else []
        chain = base + list(range(self.next_hash, self.next_hash + extra))
        if not chain:
            chain = [self.next_hash]
            extra = 1
        self._request(chain, extra)

    @precondition(lambda self: any(c[0] in self.model.host or c[0] in self.model.disk for c in self.chains))
    @rule(pick=st.integers(0, 1 << 16), keep=st.integers(1, 5))
    def revisit(self, pick: int, keep: int) -> None:
        """A request for an earlier chain whose start left the device: an onboard."""
        model = self.model
        chains = [c for c in self.chains if c[0] in model.host or c[0] in model.disk]
        self._request(chains[pick % len(chains)][:keep], 0)

    def _request(self, chain: list[int], extra: int) -> None:
        model, pool, tiers = self.model, self.kv.block_pool, self.tiers
        while True:
            n_hits = model.hits(chain)
            free_hits = sum(1 for h in chain[:n_hits] if h in model.free_lru)
            if len(chain) - n_hits <= model.num_free - free_hits:
                break
            if not self.held:
                return  # longer than the device
            self._free(0)  # the oldest request finishes to make room, as a scheduler's would
        hit_blocks = [pool.cached_block_hash_to_block[h] for h in chain[:n_hits]]
        assert [b.block_hash for b in hit_blocks] == chain[:n_hits]
        self.next_hash += extra
        self.chains.append(chain)

        media = model.plan(chain, n_hits)
        plan = tiers.find(chain, n_hits, len(chain))
        assert (plan.media if plan else []) == media
        staged: dict = {}
        if plan is not None:
            first = tiers.first_unread(plan, None)
            event(f"onboard {'+'.join(sorted(set(plan.media)))}")
            if first < len(plan.entries):  # some bytes are only in files: read them first
                event("onboard waits for block files")
                assert tiers.start_reads(plan, staged)
                self._settle()
                for h, data in tiers.poll().items():
                    assert data is not None
                    staged[h] = data
                assert tiers.first_unread(plan, staged) == len(plan.entries)

        model.touch(chain[:n_hits])
        pool.touch(hit_blocks)
        new_blocks = pool.get_new_blocks(len(chain) - n_hits)
        keys = list(chain[:n_hits]) + model.allocate(len(chain) - n_hits)
        model.onboard(chain[n_hits:], media)
        if plan is not None:
            tiers.onboard(plan, new_blocks[:len(media)], staged)
            for block, h in zip(new_blocks, chain[n_hits:n_hits + len(media)], strict=False):
                assert np.array_equal(self.rows[block.block_id], content(h)), "onboarded bytes differ"
        for block, h in zip(new_blocks[len(media):], chain[n_hits + len(media):], strict=True):
            self.rows[block.block_id] = content(h)  # computed
        blocks = hit_blocks + new_blocks
        local = chain  # the tiers only keep them, so any distinct ints do as local hashes
        pool.cache_full_blocks(blocks, chain, local, n_hits, len(chain), None)
        for i in range(n_hits, len(chain)):
            keys[i] = model.cache(keys[i], chain[i])
        self.held.append((keys, blocks))
        model.flush()
        self._take_events()

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 1 << 16))
    def free(self, pick: int) -> None:
        self._free(pick % len(self.held))

    def _free(self, i: int) -> None:
        keys, blocks = self.held.pop(i)
        self.kv.block_pool.free_blocks(reversed(blocks))
        self.model.free(keys)
        self._take_events()

    @rule(medium=st.sampled_from([None, MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK]))
    def clear(self, medium: str | None) -> None:
        self.kv.reset_prefix_cache(medium)
        self.model.clear(medium, [keys for keys, _ in self.held])
        self._take_events()

    @rule()
    def settle(self) -> None:
        """The disk catches up: every file is written or deleted, and the step takes it in."""
        self._settle()
        assert self.tiers.poll() == {}
        files = {int(p.stem, 16) for p in self.store.directory.glob("*.kvb")}
        assert files == set(self.tiers.disk.entries)
        assert not list(self.store.directory.glob("*.tmp"))
        assert all(e.data is None for e in self.tiers.disk.entries.values())

    @precondition(lambda self: self.tiers.disk.entries)
    @rule()
    def restart(self) -> None:
        """The worker stops and starts again: the device and host tiers are gone, the persistent
        disk tier comes back from its files (in the order they were written, which the model does
        not track: it takes the order from the tier)."""
        self.tiers.close()
        disk_before = set(self.model.disk)
        self.held.clear()
        self._open()
        restored = list(self.tiers.disk.entries)
        event(f"restart with {'some' if restored else 'no'} disk blocks")
        assert set(restored) == disk_before
        self.model = Model(disk=restored)
        # Every restored block is readable and holds what was offloaded.
        for h in restored:
            assert np.array_equal(self.store.read(h), content(h))

    def _settle(self) -> None:
        assert self.tiers.io.wait_idle(IO_TIMEOUT), "disk I/O did not finish"

    # ---- invariants -------------------------------------------------------------------------------

    @invariant()
    def tiers_match_the_model(self) -> None:
        model, tiers, pool = self.model, self.tiers, self.kv.block_pool
        assert list(tiers.host.entries) == list(model.host)
        assert list(tiers.disk.entries) == list(model.disk)
        assert len(tiers.host) <= HOST_BLOCKS and len(tiers.disk) <= DISK_BLOCKS
        assert set(pool.cached_block_hash_to_block) == model.cached
        free = pool.free_block_queue.get_all_free_blocks()
        assert [b.block_hash for b in free if b.block_hash is not None] == list(model.free_lru)
        assert sum(1 for b in free if b.block_hash is None) == model.num_free_empty
        for entry in tiers.host.entries.values():
            assert np.array_equal(entry.data, content(entry.block_hash))

    @invariant()
    def events_give_a_router_the_tiers(self) -> None:
        assert self.view[MEDIUM_GPU] == self.model.cached
        assert self.view[MEDIUM_CPU] == set(self.model.host)
        assert self.view[MEDIUM_DISK] == set(self.model.disk)


TierMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
test_kv_tiers_follow_the_model = TierMachine.TestCase
