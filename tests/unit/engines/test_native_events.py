"""vLLM/SGLang native batches become router events with the router's own block hashes."""

from __future__ import annotations

import hashlib
import random

import msgspec

from dynamod.daemon.engines.common.native_events import NativeEventConverter, engine_hash_to_int
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, decode_native_batch

BS = 16


def _vllm_payload(events: list[dict], dp_rank: int | None = 0) -> bytes:
    """A batch exactly as vLLM publishes it: ``[ts, [event maps tagged by "type"], dp_rank]``,
    with the extra fields newer vLLM versions add."""
    return msgspec.msgpack.encode([1_700_000_000.5, events, dp_rank])


def _stored(hashes, parent, tokens, lora_name=None, medium="GPU") -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None if lora_name is None else 1,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def test_vllm_batch_is_rehashed_with_the_router_hashes():
    rng = random.Random(3)
    prompt = [rng.randrange(32000) for _ in range(4 * BS + 5)]
    # vLLM's sha256 mode: 32-byte hashes; the int mode: signed 64-bit values.
    engine = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    payload = _vllm_payload(
        [
            _stored(engine[:2], None, prompt[: 2 * BS]),
            _stored([-5, 2**63 + 7], engine[1], prompt[2 * BS : 4 * BS]),
            {"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        dp_rank=1,
    )
    conv = NativeEventConverter(worker_id=0xABC, first_event_id=10)
    events = conv.convert(decode_native_batch(payload))

    assert [e.event_id for e in events] == [10, 11, 12, 13]
    assert {(e.worker_id, e.dp_rank) for e in events} == {(0xABC, 1)}
    first, second, removed, cleared = (e.event for e in events)
    local = compute_block_hashes(prompt, BS)
    assert isinstance(first, KvStored) and first.parent_hash is None
    assert [b.tokens_hash for b in first.blocks] == local[:2]
    assert [b.block_hash for b in first.blocks] == [engine_hash_to_int(h) for h in engine[:2]]
    assert isinstance(second, KvStored)
    assert second.parent_hash == first.blocks[1].block_hash
    assert [b.tokens_hash for b in second.blocks] == local[2:4]
    assert [b.block_hash for b in second.blocks] == [(-5) % 2**64, 2**63 + 7]
    assert isinstance(removed, KvRemoved) and removed.block_hashes == [(-5) % 2**64]
    assert isinstance(cleared, KvCleared)

    # Fed to the index, the prompt's own hashes match all four blocks until the removal.
    index = KvIndexer()
    for ev in events[:2]:
        index.apply_event(ev)
    assert index.find_matches(local).scores == {(0xABC, 1): 4}
    index.apply_event(events[2])
    assert index.find_matches(local).scores == {(0xABC, 1): 2}


def test_lora_name_salts_the_hash_and_lower_tiers_keep_their_medium():
    tokens = list(range(BS))
    payload = _vllm_payload(
        [
            _stored([1], None, tokens, lora_name="sql-adapter"),
            _stored([2], None, tokens, medium="CPU"),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
            _stored([3], None, tokens, medium="REMOTE_POOL"),  # a tier we do not know: dropped
        ]
    )
    events = NativeEventConverter(worker_id=1).convert(decode_native_batch(payload))
    stored, host, host_removed = (e.event for e in events)
    assert stored.blocks[0].tokens_hash == compute_block_hashes(tokens, BS, "sql-adapter")[0]
    assert stored.blocks[0].tokens_hash != compute_block_hashes(tokens, BS)[0]
    assert stored.lora_name == "sql-adapter" and stored.medium == "GPU"
    assert isinstance(host, KvStored) and host.medium == "CPU"
    assert host.blocks[0].tokens_hash == compute_block_hashes(tokens, BS)[0]
    assert isinstance(host_removed, KvRemoved) and host_removed.medium == "CPU"
    gpu_only = NativeEventConverter(worker_id=1, mediums=("GPU",)).convert(decode_native_batch(payload))
    assert [e.event.medium for e in gpu_only] == ["GPU"]


def test_bytes_hash_conversion_is_stable_and_uses_every_byte():
    h = hashlib.sha256(b"block").digest()
    assert engine_hash_to_int(h) == engine_hash_to_int(bytes(h))
    assert engine_hash_to_int(h) != engine_hash_to_int(h + b"\x00\x01")  # a group id appended
    assert 0 <= engine_hash_to_int(h) < 2**64
    assert engine_hash_to_int(2**64 + 3) == 3


def test_short_token_list_keeps_only_hashable_blocks():
    payload = _vllm_payload([_stored([1, 2, 3], None, list(range(2 * BS + 3)))])
    (ev,) = NativeEventConverter(worker_id=1).convert(decode_native_batch(payload))
    assert [b.block_hash for b in ev.event.blocks] == [1, 2]


def test_offload_media_map_onto_ours() -> None:
    """vLLM's offloading connector announces its host copies with medium "CPU"; a disk backend
    may name its tier otherwise: both land on our media, and the GPU stays the default."""
    from dynamod.daemon.engines.common.native_events import convert_native_event, medium_of
    from dynamod.shared.protocol.kv_events import BlockRemoved, BlockStored

    assert [medium_of(m) for m in (None, "GPU", "cpu", "LOCAL_DISK", "nvme", "STORAGE")] == [
        "GPU", "GPU", "CPU", "DISK", "DISK", "DISK"
    ]
    stored = convert_native_event(
        BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, medium="CPU"),
        mediums=("GPU", "CPU", "DISK"),
    )
    assert stored is not None and stored.medium == "CPU"
    removed = convert_native_event(BlockRemoved(block_hashes=[7], medium="GPU"), mediums=("GPU", "CPU"))
    assert removed is not None and removed.medium == "GPU"
    assert convert_native_event(BlockRemoved(block_hashes=[7], medium="CPU"), mediums=("GPU",)) is None
