"""vLLM's native KV events, recorded from a real vLLM 0.32 engine, through our subscriber, converter
and block table: what reaches the router and what ``kv_dump`` answers."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from dynamod.daemon.engines.common.kv_endpoints import SubscriberEndpoint
from dynamod.daemon.engines.common.kv_subscriber import NativeKvSubscriber
from dynamod.daemon.engines.common.native_events import engine_hash_to_int
from dynamod.daemon.engines.common.native_kv import NativeKvEventQueue
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCleared,
    KvRemoved,
    KvStored,
    decode_native_batch,
)
from tests.unit.engines.recorded import frames, load

WORKER = 0x5EED
BLOCK = 32
REC = load("vllm_0.32_kv_events.json")
LIVE = frames(REC)
REPLAY = frames(REC, "replay_from_seq_1")


def test_recording_is_vllms_wire_format() -> None:
    topics = {m[0] for m in LIVE}
    assert topics == {REC["topic"].encode()}
    assert [int.from_bytes(m[1], "big") for m in LIVE] == list(range(len(LIVE)))
    kinds = [type(e) for m in LIVE for e in decode_native_batch(m[2]).events]
    assert {BlockStored, BlockRemoved, AllBlocksCleared} <= set(kinds)
    lora = [e for m in LIVE for e in decode_native_batch(m[2]).events if isinstance(e, BlockStored) and e.lora_name]
    assert lora and lora[0].lora_name == "tiny-lora" and lora[0].block_size == BLOCK


def feed_all(feed: NativeKvEventQueue, messages: list[list[bytes]]) -> None:
    for m in messages:
        feed.on_batch(0, decode_native_batch(m[2]))


def drain(feed: NativeKvEventQueue) -> list:
    out = []
    while not feed._queue.empty():  # noqa: SLF001 - the test reads what the daemon would
        ev = feed._queue.get_nowait()
        if ev is not None:
            out.append(ev)
    return out


def test_first_batch_becomes_router_hashes_of_the_prompt() -> None:
    feed = NativeKvEventQueue(WORKER)
    feed_all(feed, LIVE[:1])
    [ev] = drain(feed)
    assert ev.worker_id == WORKER and ev.event_id == 0 and isinstance(ev.event, KvStored)
    native = decode_native_batch(LIVE[0][2]).events[0]
    # The recording's first prompt was token ids 1000..1099: three full blocks.
    assert native.token_ids == list(range(1000, 1096))
    assert [b.tokens_hash for b in ev.event.blocks] == compute_block_hashes(list(range(1000, 1096)), BLOCK)
    assert [b.block_hash for b in ev.event.blocks] == [engine_hash_to_int(h) for h in native.block_hashes]


def test_router_index_follows_the_whole_recording_and_the_dump_matches_it() -> None:
    feed = NativeKvEventQueue(WORKER)
    index = KvIndexer()
    feed_all(feed, LIVE[:-1])  # up to before the final reset
    events = drain(feed)
    assert [e.event_id for e in events] == list(range(len(events)))
    for ev in events:
        index.apply_event(ev)
    removed = sum(isinstance(e.event, KvRemoved) for e in events)
    assert removed == 4
    held = index.tree_size((WORKER, 0))
    assert held == feed.table.num_blocks() > 0
    # A router that missed everything rebuilds the same picture from the dump.
    fresh = KvIndexer()
    dump = feed.dump()
    assert all(d.event_id == feed.last_event_id for d in dump)
    for ev in dump:
        fresh.apply_event(ev)
    prompt = list(range(1000, 1000 + 100)) + list(range(2000, 2040))
    assert fresh.tree_size((WORKER, 0)) == held
    assert fresh.find_matches(compute_block_hashes(prompt, BLOCK)).scores == index.find_matches(
        compute_block_hashes(prompt, BLOCK)
    ).scores


def test_lora_blocks_are_hashed_with_the_adapter_name() -> None:
    feed = NativeKvEventQueue(WORKER)
    feed_all(feed, LIVE[:3])
    lora_events = [e for e in drain(feed) if isinstance(e.event, KvStored) and e.event.lora_name]
    [ev] = lora_events
    base = list(range(1000, 1096))
    assert [b.tokens_hash for b in ev.event.blocks] == compute_block_hashes(base, BLOCK, "tiny-lora")
    assert [b.tokens_hash for b in ev.event.blocks] != compute_block_hashes(base, BLOCK)


def test_cleared_cache_empties_table_and_index() -> None:
    feed = NativeKvEventQueue(WORKER)
    index = KvIndexer()
    feed_all(feed, LIVE)
    for ev in drain(feed):
        index.apply_event(ev)
    # The last batch is [AllBlocksCleared, BlockStored(2 blocks)]: only the new blocks remain.
    assert feed.table.num_blocks() == 2 == index.tree_size((WORKER, 0))
    feed.emit(0, KvCleared())
    for ev in drain(feed):
        index.apply_event(ev)
    assert feed.table.num_blocks() == 0 == index.tree_size((WORKER, 0))


def test_lost_batches_leave_an_id_gap_for_the_router() -> None:
    feed = NativeKvEventQueue(WORKER)
    feed_all(feed, LIVE[:1])
    feed.on_gap(0, 2)
    feed_all(feed, LIVE[1:2])
    ids = [e.event_id for e in drain(feed)]
    assert ids == [0, 2]


def test_full_buffer_drops_and_leaves_a_gap() -> None:
    feed = NativeKvEventQueue(WORKER, buffer=1)
    feed_all(feed, LIVE[:2])
    [kept] = drain(feed)
    assert kept.event_id == 0 and feed.dropped == 1
    feed_all(feed, LIVE[2:3])
    assert [e.event_id for e in drain(feed)] == [2]


# -- the subscriber over real ZMQ sockets ---------------------------------------------------------


class FakePublisher:
    """vLLM's publisher behaviour: PUB connecting to our bound SUB, ROUTER replay of a buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, sub_address: str, replay_address: str) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.connect(sub_address)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(replay_address)
        self.buffer: list[list[bytes]] = []
        self.serving = asyncio.create_task(self._serve())

    async def send(self, message: list[bytes], *, drop: bool = False) -> None:
        self.buffer.append(message)
        if not drop:
            await self.pub.send_multipart(message)

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for m in self.buffer:
                if int.from_bytes(m[1], "big") >= first:
                    await self.router.send_multipart([client, b"", *m])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self.serving.cancel()
        await asyncio.gather(self.serving, return_exceptions=True)
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
async def wired(tmp_path):
    ctx = zmq.asyncio.Context()
    replay_address = f"ipc://{tmp_path}/replay.ipc"
    got: list[tuple[int, int]] = []
    gaps: list[int] = []
    feed = NativeKvEventQueue(WORKER)

    def on_batch(rank, batch):
        got.append(len(batch.events))
        feed.on_batch(rank, batch)

    def on_gap(rank, missing):
        gaps.append(missing)
        feed.on_gap(rank, missing)

    sub = NativeKvSubscriber(
        [SubscriberEndpoint("tcp://127.0.0.1:*", bind=True)],
        decode=decode_native_batch, on_batch=on_batch, on_gap=on_gap, topic=REC["topic"],
        replay={0: replay_address}, ctx=ctx, replay_timeout_s=1.0,
    )
    sub.open()
    pub = FakePublisher(ctx, sub.bound[0], replay_address)
    try:
        yield sub, pub, feed, got, gaps
    finally:
        await pub.close()
        await sub.close()
        ctx.term()


async def wait_for(cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 - polls a condition with a deadline
            await asyncio.sleep(0.01)


async def test_publisher_connecting_while_the_loop_is_busy_elsewhere_loses_nothing(wired) -> None:
    sub, pub, feed, got, gaps = wired
    # The engine connects during start-up while the loop waits on something else; the pending
    # receive makes the SUB send its subscription anyway.
    await asyncio.sleep(0.3)
    for m in LIVE:
        await pub.send(m)
    await wait_for(lambda: len(got) == len(LIVE))
    assert gaps == [] and sub.replayed == 0
    assert [e.event_id for e in drain(feed)] == list(range(len(converted(LIVE))))


def converted(messages: list[list[bytes]]) -> list:
    """Router events the recording converts to (no medium filtering drops any here)."""
    feed = NativeKvEventQueue(WORKER)
    feed_all(feed, messages)
    return drain(feed)


async def test_missed_batches_are_replayed_in_order(wired) -> None:
    sub, pub, feed, got, gaps = wired
    await asyncio.sleep(0.2)
    await pub.send(LIVE[0])
    await pub.send(LIVE[1], drop=True)
    await pub.send(LIVE[2], drop=True)
    await pub.send(LIVE[3])
    await wait_for(lambda: len(got) == 4)
    assert gaps == [] and sub.replayed == 2
    assert [e.event_id for e in drain(feed)] == list(range(len(converted(LIVE[:4]))))


async def test_batches_the_replay_no_longer_holds_become_a_gap(wired) -> None:
    sub, pub, feed, got, gaps = wired
    await asyncio.sleep(0.2)
    await pub.send(LIVE[0])
    await pub.send(LIVE[1], drop=True)
    pub.buffer.remove(LIVE[1])  # rotated out of the publisher's replay buffer
    await pub.send(LIVE[2])
    await wait_for(lambda: len(got) == 2)
    assert gaps == [1] and sub.gaps == 1
    ids = [e.event_id for e in drain(feed)]
    assert ids[0] == 0 and ids[1] == 2  # id 1 skipped: the router resyncs from kv_dump


def test_fake_replay_replies_exactly_as_recorded_vllm() -> None:
    """vLLM's replay reply as a DEALER receives it: [b"", topic, seq, payload] per batch, then END."""
    assert REPLAY[:-1] == [[b"", *m] for m in LIVE[1:]]
    assert REPLAY[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
