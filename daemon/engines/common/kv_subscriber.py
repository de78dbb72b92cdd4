"""Receives an engine's native KV event batches over ZMQ, in order, and notices what it missed.

Frames are ``[topic, seq (u64 big-endian), payload]``; each data-parallel rank's publisher numbers
its batches from 0. The subscriber expects exactly the next number per rank (one replayed
``EventSequence`` per rank, shared/events/seq.py). When a batch arrives early it asks the
publisher's replay socket (a ROUTER that keeps the last batches) for the missing ones; what cannot
be replayed is reported as a gap, so the owner can make the router re-read the worker. A batch
numbered lower than expected is a duplicate (replay overlapping the live stream) unless it is 0,
which means the publisher restarted.

A bound SUB socket learns of a connecting publisher only when the application touches the socket
(libzmq runs the attach command in the socket's thread), and until its subscription reaches the
publisher, the publisher drops everything. So the receive task is started before the engine and
keeps a receive pending at all times; ``open()`` must run on the event loop that will serve it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from dynamod.daemon.engines.common.kv_endpoints import SubscriberEndpoint
from dynamod.shared.events.seq import Arrival, EventSequences
from dynamod.shared.protocol.kv_events import KvEventBatch
from dynamod.shared.tasks import stop_task

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_RCVHWM = 100_000
DEFAULT_REPLAY_TIMEOUT_S = 1.0

BatchHandler = Callable[[int, KvEventBatch], None]
GapHandler = Callable[[int, int], None]


class NativeKvSubscriber:
    """One SUB socket on every rank's publisher; calls ``on_batch(rank, batch)`` in seq order and
    ``on_gap(rank, missing)`` for batches lost for good."""

    def __init__(
        self,
        endpoints: list[SubscriberEndpoint],
        *,
        decode: Callable[[bytes], KvEventBatch],
        on_batch: BatchHandler,
        on_gap: GapHandler,
        topic: str = "",
        replay: dict[int, str] | None = None,
        ctx: zmq.asyncio.Context | None = None,
        rcvhwm: int = DEFAULT_RCVHWM,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self._endpoints = endpoints
        self._decode = decode
        self._on_batch = on_batch
        self._on_gap = on_gap
        self._topic = topic.encode()
        self._replay_endpoints = dict(replay or {})
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._rcvhwm = rcvhwm
        self._replay_timeout_s = replay_timeout_s
        self._sub: zmq.asyncio.Socket | None = None
        self._dealers: dict[int, zmq.asyncio.Socket] = {}
        self._seqs: EventSequences[int] = EventSequences(first=0, replays=True)
        self._task: asyncio.Task[None] | None = None
        self.bound: list[str] = []  # the addresses bound, ports resolved ("tcp://127.0.0.1:*" -> real)
        # Counters for logs, metrics and tests.
        self.batches = 0
        self.replayed = 0
        self.gaps = 0  # reported to the owner: batches lost for good, or a publisher restart
        self.missed = 0
        self.malformed = 0

    def open(self) -> None:
        """Binds/connects the SUB socket and starts receiving (call before the engine starts)."""
        if self._sub is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)  # before bind/connect, or it does not apply
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        for ep in self._endpoints:
            if ep.bind:
                sub.bind(ep.address)
                self.bound.append(sub.getsockopt_string(zmq.LAST_ENDPOINT))
            else:
                sub.connect(ep.address)
        self._sub = sub
        self._task = asyncio.create_task(self._receive_loop(), name="native-kv-subscriber")
        logger.info(
            "kv subscriber open endpoints=%s replay=%s topic=%s",
            ",".join(f"{'bind' if e.bind else 'connect'}:{e.address}" for e in self._endpoints),
            ",".join(self._replay_endpoints.values()) or "none",
            self._topic.decode(errors="replace") or "*",
        )

    async def close(self) -> None:
        task, self._task = self._task, None
        try:
            # A caller cancelled while waiting here gets its CancelledError, after the cleanup below.
            await stop_task(task)
        finally:
            for sock in [self._sub, *self._dealers.values()]:
                if sock is not None:
                    sock.close(linger=0)
            self._sub = None
            self._dealers.clear()
            if self._own_ctx:
                self._ctx.term()

    @property
    def duplicates(self) -> int:
        return self._seqs.counts.duplicates

    @property
    def restarts(self) -> int:
        return self._seqs.counts.restarts

    def expected_seq(self, rank: int) -> int:
        expected = self._seqs.of(rank).expected
        assert expected is not None  # a sequence with a first id always expects one
        return expected

    # -- receiving -------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._sub is not None
        sub = self._sub
        while True:
            frames = await sub.recv_multipart()
            try:
                await self._handle(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad batch must not end the stream
                self.malformed += 1
                logger.exception("kv subscriber failed on a batch frames=%d", len(frames))

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            logger.warning("kv subscriber malformed message frames=%d", len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        batch = self._decode(frames[2])
        rank = batch.data_parallel_rank or 0
        expected = self.expected_seq(rank)
        if seq > expected:
            await self._recover(rank, expected, seq)
        resumed = self.expected_seq(rank)  # after what the replay still held
        arrival = self._seqs.observe(rank, seq)
        if arrival is Arrival.DUPLICATE:
            return
        if arrival is Arrival.RESTART:
            logger.warning("kv publisher restarted dp_rank=%d expected_seq=%d", rank, expected)
            self._report_gap(rank, 1)
        elif arrival is Arrival.GAP:
            self._report_gap(rank, seq - resumed)
        self._deliver(rank, batch)

    def _deliver(self, rank: int, batch: KvEventBatch) -> None:
        self.batches += 1
        self._on_batch(rank, batch)

    def _report_gap(self, rank: int, missing: int) -> None:
        self.gaps += 1
        self.missed += missing
        self._on_gap(rank, missing)

    async def _recover(self, rank: int, start: int, stop: int) -> None:
        """Delivers batches ``start .. stop-1`` from the replay socket, as far as it still holds them."""
        replayed = await self._replay(rank, start, stop)
        sequence = self._seqs.of(rank)
        nxt = start
        for seq, payload in replayed:
            if seq < nxt:
                continue
            if seq > nxt:
                break  # the replay buffer no longer holds nxt
            batch = self._decode(payload)
            sequence.observe(seq)  # in order: seq is the one expected
            self._deliver(rank, batch)
            self.replayed += 1
            nxt += 1
        if nxt < stop:
            logger.warning(
                "kv events lost dp_rank=%d first_missing_seq=%d next_seq=%d replayed=%d",
                rank, nxt, stop, nxt - start,
            )
        else:
            logger.info("kv events replayed dp_rank=%d from_seq=%d count=%d", rank, start, stop - start)

    async def _replay(self, rank: int, start: int, stop: int) -> list[tuple[int, bytes]]:
        endpoint = self._replay_endpoints.get(rank)
        if endpoint is None:
            return []
        dealer = self._dealers.get(rank)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            self._dealers[rank] = dealer
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(self._replay_timeout_s):
                    frames = await dealer.recv_multipart()
                # vLLM replies [b"", topic, seq, payload], SGLang [b"", seq, payload]; both end
                # with seq -1 and an empty payload.
                if len(frames) < 3:
                    break
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if seq >= stop:
                    continue  # the live stream delivers these
                out.append((seq, payload))
        except TimeoutError:
            # A late reply would confuse the next request: start over with a fresh socket.
            logger.warning("kv replay timed out dp_rank=%d endpoint=%s from_seq=%d", rank, endpoint, start)
            self._dealers.pop(rank).close(linger=0)
        return out
