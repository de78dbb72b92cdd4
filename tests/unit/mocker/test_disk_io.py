"""The disk tier's files move on a background thread: a block being written is onboarded from
memory and has no valid file yet; a request whose prefix must be read from files waits off the
batch while others keep stepping; a full queue refuses work instead of blocking; failures drop the
block; shutdown flushes (persistent) or discards (not) its queued writes, and a crash mid-write
leaves no block file behind a valid name."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dynamod.daemon.engines.mocker import core as core_module
from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.engines.mocker.disk_io import READ, WRITE, DiskIo
from dynamod.daemon.engines.mocker.disk_tier import DiskStore
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.engines.mocker.request import RequestStatus
from dynamod.daemon.engines.mocker.tier_entry import TierEntry
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_events import MEDIUM_DISK, MEDIUM_GPU, KvRemoved, KvStored
from dynamod.shared.protocol.kv_transfer import KvLayout
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions
from tests.unit.mocker.factories import make_config, run_to_completion

BS = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2, block_size=BS)  # 32 B/token
PROMPT_A = list(range(10, 23))  # 13 tokens: 3 full blocks
PROMPT_B = list(range(40, 53))
TIMEOUT = 10.0


class GatedStore(DiskStore):
    """A disk store whose thread can be held between writing a file's temporary name and renaming
    it (``publish_gate``) or before reading a file (``read_gate``): a slow disk, on demand."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.publish_gate: threading.Event | None = None
        self.read_gate: threading.Event | None = None
        self.publishing = threading.Event()  # the thread waits at the publish gate
        self.reading = threading.Event()

    def _publish(self, tmp: Path, path: Path) -> None:
        if self.publish_gate is not None:
            self.publishing.set()
            assert self.publish_gate.wait(TIMEOUT)
        super()._publish(tmp, path)

    def read(self, block_hash: int) -> np.ndarray:
        if self.read_gate is not None:
            self.reading.set()
            assert self.read_gate.wait(TIMEOUT)
        return super().read(block_hash)


@pytest.fixture(autouse=True)
def gated_store(monkeypatch):
    monkeypatch.setattr(core_module, "DiskStore", GatedStore)


def disk_core(tmp_path: Path, *, host: int = 0, disk: int = 8, persist: bool = False, queue: int = 64,
              gpu: int = 4, **overrides) -> MockerCore:
    config = make_config(
        num_gpu_blocks=gpu, num_host_blocks=host, num_disk_blocks=disk, disk_cache_dir=str(tmp_path / "disk"),
        disk_cache_persist=persist, disk_io_queue_blocks=queue, **overrides,
    )
    memory = KvBlockMemory(config.num_gpu_blocks, LAYOUT.block_bytes)
    return MockerCore(config, kv_memory=memory, kv_layout=LAYOUT)


def store_of(core: MockerCore) -> GatedStore:
    store = core.tiers.disk_store
    assert isinstance(store, GatedStore)
    return store


def held_store(core: MockerCore) -> GatedStore:
    """The core's disk store with every write held at its publish step until ``publish_gate`` is set."""
    store = store_of(core)
    store.publish_gate = threading.Event()
    return store


def run(core: MockerCore, rid: str, prompt: list[int]) -> list:
    core.add_request(rid, prompt, max_tokens=1, ignore_eos=True)
    return run_to_completion(core)


def evs(outs) -> list:
    return [e for out in outs for e in out.kv_events]


def stored(events, medium: str) -> list[int]:
    return [b.block_hash for e in events if isinstance(e, KvStored) and e.medium == medium for b in e.blocks]


def removed(events, medium: str) -> list[int]:
    return [h for e in events if isinstance(e, KvRemoved) and e.medium == medium for h in e.block_hashes]


def rows(core: MockerCore, hashes: list[int]) -> np.ndarray:
    pool = core.kv_manager.block_pool
    return np.stack([core.kv_writer.memory.array[pool.cached_block_hash_to_block[h].block_id] for h in hashes])


def block_files(core_or_dir) -> list[str]:
    directory = core_or_dir if isinstance(core_or_dir, Path) else core_or_dir.tiers.disk_store.directory
    return sorted(p.name for p in directory.iterdir())


def offload_a(core: MockerCore) -> tuple[list[int], np.ndarray]:
    """Caches A, then pushes it off the device with B (to disk, or host then disk)."""
    a_hashes = stored(evs(run(core, "a", PROMPT_A)), MEDIUM_GPU)
    original = rows(core, a_hashes).copy()
    run(core, "b", PROMPT_B)
    return a_hashes, original


def offload_a_until_writing(core: MockerCore, store: GatedStore) -> tuple[list[int], np.ndarray]:
    """``offload_a`` on a held store, returning once the first block is being written (under its
    temporary name)."""
    offloaded = offload_a(core)
    assert store.publishing.wait(TIMEOUT)
    return offloaded


def test_a_block_being_written_is_onboarded_from_memory_and_has_no_file_yet(tmp_path):
    core = disk_core(tmp_path)
    store = held_store(core)
    a_hashes, original = offload_a_until_writing(core, store)
    assert set(core.tiers.disk.entries) == set(a_hashes)  # the index has them at once
    assert not [n for n in block_files(core) if n.endswith(".kvb")]  # no valid file yet
    assert core.io_pending == 3

    core.kv_writer.memory.array[:] = 0
    core.add_request("a2", PROMPT_A, max_tokens=1, ignore_eos=True)
    first = core.step()  # admitted in the first step: no read to wait for, the bytes are in memory
    assert first.num_prefill_tokens == 1 and first.onboard_ms >= 0
    assert core.scheduler.reading_from_disk == {}
    run_to_completion(core)
    assert np.array_equal(rows(core, a_hashes), original)

    store.publish_gate.set()
    assert core.tiers.io.wait_idle(TIMEOUT)
    # Every block in the index has its file now (running "a2" pushed B's blocks to disk too).
    assert block_files(core) == sorted(f"{h:016x}.kvb" for h in core.tiers.disk.entries)
    assert set(a_hashes) <= set(core.tiers.disk.entries)
    core.step()  # polls the writes: the files are the copies now
    assert all(entry.data is None for entry in core.tiers.disk.entries.values())
    assert core.io_pending == 0
    core.close()


def test_a_request_waits_for_its_block_files_while_others_keep_stepping(tmp_path):
    core = disk_core(tmp_path, gpu=8, disk=16)
    a_hashes, original = offload_a(core)
    run(core, "c", list(range(60, 77)))  # 4 more blocks: A leaves the device for the disk
    assert set(a_hashes) <= set(core.tiers.disk.entries)
    assert core.tiers.io.wait_idle(TIMEOUT)
    core.step()  # takes the writes in: A's blocks are only in their files now
    assert all(core.tiers.disk.get(h).data is None for h in a_hashes)
    store = store_of(core)
    store.read_gate = threading.Event()
    core.kv_writer.memory.array[:] = 0

    core.add_request("long", list(range(80, 83)), max_tokens=12, ignore_eos=True)
    core.step()
    core.add_request("a2", PROMPT_A, max_tokens=1, ignore_eos=True)
    produced = []
    for _ in range(5):  # the disk is held: "a2" waits off the batch, "long" decodes every step
        out = core.step()
        produced.append(out.req_ids)
    assert store.reading.wait(TIMEOUT)
    assert all(ids == ["long"] for ids in produced)
    a2 = core.scheduler.requests["a2"]
    assert a2.status == RequestStatus.WAITING_FOR_DISK_KVS and a2.blocks == []
    assert core.load().num_waiting == 1

    store.read_gate.set()
    outs = run_to_completion(core)
    fin = {f.request_id: f for out in outs for f in out.finished}
    assert fin["a2"].usage.cached_tokens == 12  # onboarded from the files, not recomputed
    assert np.array_equal(rows(core, a_hashes), original)
    assert core.load().tiers[MEDIUM_DISK].onboarded_blocks == 3
    core.close()


def test_an_unreadable_block_file_is_dropped_and_its_prefix_recomputed(tmp_path):
    core = disk_core(tmp_path)
    a_hashes, _ = offload_a(core)
    assert core.tiers.io.wait_idle(TIMEOUT)
    core.step()
    lost = a_hashes[1]
    store_of(core).path_of(lost).write_bytes(b"DKVB\x01 garbage")  # truncated under the tier

    outs = run(core, "a2", PROMPT_A)
    [fin] = [f for out in outs for f in out.finished]
    assert fin.usage.cached_tokens == 4  # the first block onboarded, the rest recomputed
    assert removed(evs(outs), MEDIUM_DISK) == [lost]
    assert lost not in core.tiers.disk and core.tiers.stats.disk_io_failures == 1
    assert core.tiers.io.wait_idle(TIMEOUT)
    assert f"{lost:016x}.kvb" not in block_files(core)
    core.close()


def test_a_full_io_queue_skips_the_disk_instead_of_blocking_the_step(tmp_path):
    core = disk_core(tmp_path, queue=1)
    store = held_store(core)
    a_hashes = stored(evs(run(core, "a", PROMPT_A)), MEDIUM_GPU)
    outs = run(core, "b", PROMPT_B)  # 3 offloads, a queue of 1: two are refused
    on_disk = stored(evs(outs), MEDIUM_DISK)
    assert len(on_disk) == 1 and set(core.tiers.disk.entries) == set(on_disk)
    assert core.tiers.stats.disk_writes_refused == 2 and core.tiers.stats.offloaded[MEDIUM_DISK] == 1
    assert set(on_disk) < set(a_hashes)
    store.publish_gate.set()
    assert core.tiers.io.wait_idle(TIMEOUT)
    assert block_files(core) == [f"{on_disk[0]:016x}.kvb"]
    core.close()


def test_shutdown_flushes_queued_writes_of_a_persistent_tier(tmp_path):
    core = disk_core(tmp_path, persist=True)
    store = held_store(core)
    a_hashes, original = offload_a_until_writing(core, store)
    threading.Timer(0.05, store.publish_gate.set).start()  # the disk catches up during close
    core.close()  # waits for the three queued writes
    assert block_files(tmp_path / "disk" / "dp0") == sorted(f"{h:016x}.kvb" for h in a_hashes)

    again = disk_core(tmp_path, persist=True)
    assert sorted(stored(again.take_events(), MEDIUM_DISK)) == sorted(a_hashes)
    outs = run(again, "a2", PROMPT_A)
    assert outs[-1].finished[0].usage.cached_tokens == 12
    assert np.array_equal(rows(again, a_hashes), original)
    again.close()


def test_shutdown_discards_queued_writes_of_a_throwaway_tier(tmp_path):
    core = disk_core(tmp_path, persist=False)
    store = held_store(core)
    offload_a_until_writing(core, store)
    closer = threading.Thread(target=core.close)
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while not core.tiers.io.closing:
        assert time.monotonic() < deadline, "close did not begin"
        time.sleep(0.001)
    store.publish_gate.set()  # the write in progress ends; the two queued behind it are dropped
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert store.bytes_written <= LAYOUT.block_bytes
    assert not (tmp_path / "disk" / "dp0").exists()


def test_a_crash_mid_write_leaves_no_block_file_behind_a_valid_name(tmp_path):
    core = disk_core(tmp_path, persist=True)
    store = held_store(core)
    offload_a_until_writing(core, store)
    # What a crash now leaves on disk: the directory as it is, one file under its temporary name.
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / "disk", crashed)
    assert [n for n in block_files(crashed / "dp0") if n.endswith(".tmp")]
    store.publish_gate.set()
    core.close()

    config = make_config(num_gpu_blocks=4, num_disk_blocks=8, disk_cache_dir=str(crashed), disk_cache_persist=True)
    restarted = MockerCore(config, kv_memory=KvBlockMemory(4, LAYOUT.block_bytes), kv_layout=LAYOUT)
    assert restarted.take_events() == [] and len(restarted.tiers.disk) == 0
    assert block_files(crashed / "dp0") == []  # the temporary file is cleaned up, not loaded
    restarted.close()


def test_io_thread_orders_a_delete_after_its_write_and_cancels_queued_writes(tmp_path):
    store = GatedStore(tmp_path / "d", LAYOUT.block_bytes, persist=True)
    store.publish_gate = threading.Event()
    io = DiskIo(store, max_pending=2)
    data = np.arange(LAYOUT.block_bytes, dtype=np.uint8)
    a, b, c = (TierEntry(h, h, None, None) for h in (0xA, 0xB, 0xC))
    assert io.try_write(a, data) and io.try_write(b, data)
    assert not io.try_write(c, data)  # full: refused, nothing queued
    assert store.publishing.wait(TIMEOUT)  # A is being written, B is queued
    io.delete(0xA)  # behind A's write
    io.delete(0xB)  # B's write never starts
    assert io.pending == 1
    store.publish_gate.set()
    assert io.wait_idle(TIMEOUT)
    assert [(d.kind, d.block_hash, d.error) for d in io.poll()] == [(WRITE, 0xA, None)]
    assert list((tmp_path / "d").iterdir()) == [] and io.pending == 0

    store.read_gate = threading.Event()
    io.max_pending = 3
    assert io.try_read(0xD)  # holds the thread in a read
    assert store.reading.wait(TIMEOUT)
    assert io.try_write(c, data) and io.try_read(0xC)  # the read goes first: C's file is not there yet
    store.read_gate.set()
    assert io.wait_idle(TIMEOUT)
    done = io.poll()
    assert [(d.kind, d.block_hash, d.error is None) for d in done] == [
        (READ, 0xD, False), (READ, 0xC, False), (WRITE, 0xC, True)]
    io.close(flush=True)


async def test_the_engine_wakes_a_request_whose_block_files_were_read(tmp_path):
    def engine() -> MockerEngine:
        config = make_config(num_gpu_blocks=32, num_disk_blocks=64, disk_cache_dir=str(tmp_path / "disk"),
                             disk_cache_persist=True, speedup_ratio=10.0, vocab_size=1000)
        return MockerEngine(config, worker_id=0xD15C, kv_layout=LAYOUT)

    def req(rid: str, tokens: list[int], max_tokens: int) -> PreprocessedRequest:
        return PreprocessedRequest(request_id=rid, model="mock", token_ids=tokens,
                                   stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))

    async def generate(eng: MockerEngine, rid: str, tokens: list[int], max_tokens: int = 1) -> list:
        return [out async for out in eng.generate(req(rid, tokens, max_tokens))]

    first = engine()
    await first.start()
    await generate(first, "a", PROMPT_A)
    await generate(first, "b", list(range(40, 166)))  # 32 blocks: A leaves the device for the disk
    await first.stop()  # the files persist

    second = engine()
    store = store_of(second.cores[0])
    store.read_gate = threading.Event()
    await second.start()
    try:
        long = asyncio.create_task(generate(second, "long", list(range(80, 83)), max_tokens=120))
        a2 = asyncio.create_task(generate(second, "a2", PROMPT_A))
        deadline = time.monotonic() + TIMEOUT
        while not store.reading.is_set():  # the read has begun and holds: "long" must keep going
            assert time.monotonic() < deadline, "the disk read never started"
            await asyncio.sleep(0.005)
        tokens_before = second._active["long"].num_tokens
        while second._active["long"].num_tokens < tokens_before + 20:
            assert time.monotonic() < deadline, "the other request stopped while a disk read was held"
            await asyncio.sleep(0.005)
        assert not a2.done()
        store.read_gate.set()
        outs = await asyncio.wait_for(a2, TIMEOUT)
        assert outs[-1].usage.cached_tokens == 12
        await asyncio.wait_for(long, TIMEOUT)
    finally:
        await second.stop()
