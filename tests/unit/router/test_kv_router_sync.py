"""Event-stream gaps and resync, dump/rebuild between routers, approximate mode through the
facade, and active-sequence sync between router replicas."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.kv.router_sync import SequenceAdded, decode_sequence_event, encode_sequence_event
from dynamod.shared.protocol.kv_events import KvRemoved, KvStored, RouterEvent, StoredBlock

BS = 16


def _router(clock=None, **cfg) -> KvRouter:
    kwargs = {"clock": clock} if clock is not None else {}
    return KvRouter(KvRouterConfig(**cfg), BS, rng=random.Random(0), registry=CollectorRegistry(), **kwargs)


def _prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BS)]


def _stored(worker_id: int, event_id: int, tokens: list[int], dp_rank: int = 0) -> RouterEvent:
    local, seq = hash_tokens(tokens, BS)
    return RouterEvent(
        worker_id=worker_id,
        dp_rank=dp_rank,
        event_id=event_id,
        event=KvStored(parent_hash=None, blocks=[StoredBlock(s, h) for s, h in zip(seq, local, strict=True)]),
    )


def _removed(worker_id: int, event_id: int, tokens: list[int]) -> RouterEvent:
    _, seq = hash_tokens(tokens, BS)
    return RouterEvent(worker_id=worker_id, event_id=event_id, event=KvRemoved(block_hashes=seq[-1:]))


def test_gap_flags_resync_once_and_dump_replays_newer_events():
    flagged: list[int] = []
    router = KvRouter(KvRouterConfig(), BS, registry=CollectorRegistry(), on_resync=flagged.append)
    a, b, c = _prompt(1, 3), _prompt(2, 2), _prompt(3, 2)
    assert not router.apply_event(_stored(7, 0, a))
    assert not router.apply_event(_stored(7, 1, b))
    assert not router.apply_event(_stored(7, 1, b))  # a duplicate delivery: skipped, no gap
    assert router.apply_event(_stored(7, 3, c))  # event 2 was lost
    assert router.needs_resync(7) and flagged == [7]
    assert router.apply_event(_removed(7, 4, a))  # still pending: applied and buffered
    assert flagged == [7]

    # The worker's kv_dump, taken after event 3: a, b and c, and event 4 not yet in it.
    dump = [_stored(7, 0, a), _stored(7, 0, b), _stored(7, 0, c)]
    router.replace_worker_blocks(7, dump, last_event_id=3)
    assert not router.needs_resync(7)
    scores = router.indexer.find_matches(hash_tokens(a, BS)[0]).scores
    assert scores == {(7, 0): 2}  # event 4 (removal of a's last block) replayed on top
    assert not router.apply_event(_stored(7, 5, _prompt(4, 1)))
    assert router.apply_event(_stored(7, 7, _prompt(5, 1)))
    assert flagged == [7, 7]


def _stamped(events: list[RouterEvent], event_id: int) -> list[RouterEvent]:
    for ev in events:
        ev.event_id = event_id
    return events


def test_dump_stamped_with_its_last_event_id_resumes_the_stream():
    """Workers stamp kv_dump events with the last event id they cover; nothing else is needed."""
    router = _router()
    a, b = _prompt(1, 2), _prompt(2, 2)
    router.apply_event(_stored(5, 0, a))
    assert router.apply_event(_stored(5, 2, b))  # event 1 lost
    router.apply_event(_removed(5, 3, b))
    router.replace_worker_blocks(5, _stamped([_stored(5, 0, a), _stored(5, 0, b)], 2))
    assert not router.needs_resync(5)
    assert router.indexer.find_matches(hash_tokens(b, BS)[0]).scores == {(5, 0): 1}  # event 3 replayed
    assert not router.apply_event(_stored(5, 4, _prompt(3, 1)))


def test_empty_dump_makes_the_next_event_the_baseline():
    router = _router()
    assert router.apply_event(_stored(6, 9, _prompt(1, 1)))
    router.replace_worker_blocks(6, [])
    assert router.indexer.total_blocks == 0
    assert not router.apply_event(_stored(6, 12, _prompt(2, 1)))
    assert router.apply_event(_stored(6, 14, _prompt(3, 1)))


def test_first_event_not_zero_means_missed_history():
    router = _router()
    assert router.apply_event(_stored(9, 42, _prompt(1, 1)))
    assert router.workers_needing_resync() == {9}
    assert not router.apply_event(_stored(10, 0, _prompt(1, 1)))


def test_dump_rebuilds_an_identical_index_in_another_router():
    rng = random.Random(11)
    source = _router()
    prompts = [_prompt(i, rng.randrange(1, 6)) for i in range(12)]
    next_id = {1: 0, 2: 0, 3: 0}
    for tokens in prompts:
        for worker in rng.sample([1, 2, 3], 2):
            source.apply_event(_stored(worker, next_id[worker], tokens, dp_rank=worker % 2))
            next_id[worker] += 1
    source.apply_event(_removed(1, next_id[1], prompts[0]))
    replica = _router()
    dump = source.dump_index()
    for worker in (1, 2, 3):
        replica.replace_worker_blocks(worker, [e for e in dump if e.worker_id == worker])
    for tokens in prompts:
        local = hash_tokens(tokens, BS)[0]
        assert replica.indexer.find_matches(local) == source.indexer.find_matches(local)
    # The snapshot carried each stream's position: the replica follows the live stream on.
    for worker in (1, 2, 3):
        assert not replica.apply_event(_stored(worker, next_id[worker] + (worker == 1), _prompt(50 + worker, 1)))


def test_approximate_mode_assumes_routed_prompts_are_cached(clock):
    router = _router(clock, use_kv_events=False, router_ttl_secs=30)
    router.update_workers([(1, 0), (2, 0)])
    prompt = _prompt(1, 6)
    first = router.select_worker("a", prompt)
    router.free("a")
    again = router.select_worker("b", prompt)
    assert again.worker == first.worker and again.overlap_blocks == 6
    router.free("b")
    clock.advance(31)
    assert router.best_worker("c", prompt).overlap_blocks == 0
    # KV events are not used in this mode.
    assert not router.apply_event(_stored(1, 5, prompt))
    assert router.indexer.total_blocks == 0


def test_replicas_share_active_sequences():
    a = _router(router_replica_sync=True)
    b = _router(router_replica_sync=True)
    for r in (a, b):
        r.update_workers([(1, 0), (2, 0)])
    prompt = _prompt(1, 4)
    decision = a.select_worker("req", prompt)
    events = a.take_sync_events()
    assert [type(e).__name__ for e in events] == ["SequenceAdded"]
    for ev in events:
        b.apply_remote(decode_sequence_event(encode_sequence_event(ev)))
        a.apply_remote(ev)  # its own change comes back over the event plane: ignored
    assert b.active.active_blocks(decision.worker) == 4
    assert b.active.active_prefill_tokens(decision.worker) == 4 * BS
    assert len(a.active) == 1
    # b now sends the next identical request elsewhere, as a would.
    assert b.best_worker("next", _prompt(2, 4)).worker != decision.worker

    a.mark_prefill_done("req")
    a.free("req")
    for ev in a.take_sync_events():
        b.apply_remote(ev)
    assert len(b.active) == 0 and b.active.load(decision.worker) is None


def test_no_sync_events_without_replica_sync():
    router = _router()
    router.update_workers([(1, 0)])
    router.select_worker("r", _prompt(1, 1))
    assert router.take_sync_events() == []


async def test_next_sync_events_wakes_on_a_change():
    import asyncio

    router = _router(router_replica_sync=True)
    router.update_workers([(1, 0)])
    waiter = asyncio.create_task(router.next_sync_events())
    await asyncio.sleep(0)
    assert not waiter.done()
    router.select_worker("r", _prompt(1, 1))
    events = await asyncio.wait_for(waiter, 5)
    assert isinstance(events[0], SequenceAdded) and events[0].request_id == "r"


def test_remove_worker_forgets_everything():
    router = _router()
    router.update_workers([(1, 0), (2, 0)])
    router.apply_event(_stored(1, 0, _prompt(1, 2)))
    router.select_worker("r", _prompt(1, 2))
    router.remove_worker(1)
    assert router.workers == [(2, 0)]
    assert router.indexer.total_blocks == 0 and len(router.active) == 0
    assert not router.apply_event(_stored(1, 0, _prompt(1, 2)))  # a new incarnation starts clean


def _load(router: KvRouter, worker) -> tuple[int, int]:
    return router.active.active_blocks(worker), router.active.active_prefill_tokens(worker)


async def test_replicas_count_an_arriving_decode_as_its_router_does():
    """A decode whose KV comes from a prefill worker counts nothing on its worker until its first
    token; a replica hearing its add over the event plane must count it the same way, or it sees
    that worker as loaded by the whole prompt during the remote prefill (issue 23)."""
    a = _router(router_replica_sync=True)
    b = _router(router_replica_sync=True)
    one, two = (1, 0), (2, 0)
    for r in (a, b):
        r.update_workers([one, two])
    b.select_worker("short", _prompt(9, 2), allowed=[two])  # b's own short decode on worker two
    b.take_sync_events()

    def deliver() -> None:
        for ev in a.take_sync_events():
            b.apply_remote(decode_sequence_event(encode_sequence_event(ev)))

    await a.select_worker_waiting("long", _prompt(1, 8), allowed=[one], kv_arriving=True)
    deliver()
    assert _load(a, one) == (0, 0)
    assert _load(b, one) == _load(a, one)  # a replica, too, sees nothing there yet
    assert b.best_worker("next", _prompt(2, 2)).worker == one  # so it sends a short prompt there

    a.mark_prefill_done("long")  # the first token: the KV landed and the decode holds its blocks
    deliver()
    assert _load(a, one) == (8, 0)
    assert _load(b, one) == _load(a, one)
    a.free("long")
    deliver()
    assert b.active.load(one) is None


def test_an_add_from_a_peer_without_the_arriving_field_is_not_arriving():
    """Backward compatible both ways: an older router's add decodes as not arriving, and an older
    router decodes a new add (msgspec skips the field it does not know)."""
    import msgspec

    class OldSequenceAdded(msgspec.Struct, tag="add", kw_only=True):
        router_id: int
        request_id: str
        worker_id: int
        dp_rank: int = 0
        isl: int
        overlap_blocks: int
        local_hashes: list[int]

    old = OldSequenceAdded(router_id=3, request_id="r", worker_id=1, isl=32, overlap_blocks=0, local_hashes=[5, 6])
    ev = decode_sequence_event(msgspec.msgpack.encode(old))
    assert isinstance(ev, SequenceAdded) and ev.arriving is False
    b = _router(router_replica_sync=True)
    b.update_workers([(1, 0)])
    b.apply_remote(ev)
    assert _load(b, (1, 0)) == (2, 32)  # counted from its add, as before

    new = SequenceAdded(router_id=3, request_id="r", worker_id=1, isl=32, overlap_blocks=0, local_hashes=[5, 6],
                        arriving=True)
    back = msgspec.msgpack.Decoder(OldSequenceAdded).decode(encode_sequence_event(new))
    assert back.request_id == "r" and back.local_hashes == [5, 6]
