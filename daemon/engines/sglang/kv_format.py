"""SGLang's KV event batches, decoded into the shared native event types.

SGLang's publisher (``sglang/srt/disaggregation/kv_events.py``) sends the same ZMQ frames as vLLM
(``[topic, seq u64 BE, payload]``, replay over a ROUTER), but its msgspec structs are
``array_like``: an event is ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id]``, ``["BlockRemoved", block_hashes]`` or ``["AllBlocksCleared"]``, and the
batch is ``[ts, events]`` or, in newer releases, ``[ts, events, attn_dp_rank]``. Events carry no
``medium`` and no LoRA *name* (only an id), so LoRA blocks cannot be salted the way the router
hashes adapter prompts; they are reported under the base model's hashing with a warning once.
Map-shaped events (vLLM's layout) are accepted as well, should SGLang switch.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from dynamod.shared.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    NativeKvEvent,
    decode_native_batch,
)

logger = logging.getLogger(__name__)

_raw = msgspec.msgpack.Decoder()
_warned_lora = False


class SglangFormatError(ValueError):
    """A payload that is not an SGLang KV event batch."""


def _event(raw: Any) -> NativeKvEvent | None:
    global _warned_lora
    if isinstance(raw, dict):
        return msgspec.convert(raw, NativeKvEvent)  # type: ignore[arg-type]
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise SglangFormatError(f"not an SGLang KV event: {raw!r:.80}")
    tag, fields = raw[0], raw[1:]
    if tag == "BlockStored":
        hashes, parent, tokens, block_size = fields[0], fields[1], fields[2], fields[3]
        lora_id = fields[4] if len(fields) > 4 else None
        if lora_id and not _warned_lora:
            _warned_lora = True
            logger.warning("sglang kv events carry a lora id but no lora name lora_id=%s effect=hashed_as_base_model", lora_id)
        return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                           block_size=int(block_size), lora_id=lora_id, medium="GPU")
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(fields[0]), medium="GPU")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    logger.debug("sglang kv event of unknown type skipped type=%s", tag)
    return None


def decode_sglang_batch(payload: bytes) -> KvEventBatch:
    """An SGLang (array-shaped) or vLLM-shaped KV event batch."""
    raw = _raw.decode(payload)
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], list):
        raise SglangFormatError("not a KV event batch: expected [ts, events(, dp_rank)]")
    if raw[1] and isinstance(raw[1][0], dict):
        return decode_native_batch(payload)
    events = [ev for ev in (_event(r) for r in raw[1]) if ev is not None]
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return KvEventBatch(ts=float(raw[0]), events=events, data_parallel_rank=rank)
