"""KV cache events: the engines' native format (vLLM/SGLang) and the router's internal one.

Native (what vLLM and SGLang publish over ZMQ, and what our mocker's ZMQ publisher emits):
frames ``[topic, seq (u64 big-endian), payload]``, payload the msgpack array
``[ts, [events], dp_rank]``, each event a map tagged by ``type``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``. ``block_hashes`` there are the *engine's* hashes, which the
router cannot reproduce, so ``BlockStored`` carries ``token_ids`` and the router rehashes them.

Internal (``kv-events`` topic on the event plane): ``RouterEvent{worker_id, dp_rank, event_id,
event}`` where ``event_id`` is monotonic per worker (a gap makes the router re-read the worker via
``kv_dump``) and a stored block carries both the engine hash (``block_hash``, to match later
removals) and the router's own token hash (``tokens_hash``, what the index matches prompts on).
"""

from __future__ import annotations

from typing import Any

import msgspec

# --------------------------------------------------------------------------------------------
# Native engine format (vLLM KVEventBatch).


class BlockStored(msgspec.Struct, tag=True, kw_only=True, omit_defaults=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    # vLLM (0.32): per block, the extra keys its block hash mixed in (the LoRA name, then one
    # ``[mm_identifier, offset]`` pair per image the block covers, the cache salt, ...) or None.
    # TensorRT-LLM's ``mm_keys`` are mapped to the same shape (daemon/engines/trtllm/kv_format.py).
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, kw_only=True):
    block_hashes: list[int | bytes]
    medium: str | None = "GPU"


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


NativeKvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True):
    """vLLM's ``EventBatch``: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[NativeKvEvent]
    data_parallel_rank: int | None = None


_native_decoder = msgspec.msgpack.Decoder(KvEventBatch)


def decode_native_batch(payload: bytes) -> KvEventBatch:
    """Decodes a vLLM/SGLang batch; unknown extra fields (group_idx, ...) are ignored."""
    return _native_decoder.decode(payload)


# --------------------------------------------------------------------------------------------
# Internal router events.


# Where a block lives (vLLM's ``medium`` names): the engine's device cache, pinned host memory,
# local disk. An event without a medium is about the device cache.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)


class StoredBlock(msgspec.Struct, array_like=True, frozen=True):
    block_hash: int  # engine-side (external) sequence hash, used to match later removals
    tokens_hash: int  # router-side local hash of the block's tokens (shared/kv/hashing.py)


class KvStored(msgspec.Struct, tag="stored", kw_only=True, omit_defaults=True):
    parent_hash: int | None
    blocks: list[StoredBlock]
    lora_name: str | None = None
    medium: str = MEDIUM_GPU  # the tier the blocks now live in (MEDIA)


class KvRemoved(msgspec.Struct, tag="removed", kw_only=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str = MEDIUM_GPU  # the tier the blocks left (they may still live in another)


class KvCleared(msgspec.Struct, tag="cleared", kw_only=True, omit_defaults=True):
    medium: str | None = None  # one tier emptied; None: every tier of the worker


KvEvent = KvStored | KvRemoved | KvCleared


class RouterEvent(msgspec.Struct, kw_only=True):
    worker_id: int
    dp_rank: int = 0
    event_id: int
    event: KvEvent


router_event_encoder = msgspec.msgpack.Encoder()
router_event_decoder = msgspec.msgpack.Decoder(RouterEvent)
