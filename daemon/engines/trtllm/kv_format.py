"""TensorRT-LLM's KV cache events -> the shared native event types.

``LLM.get_kv_cache_events_async()`` yields dicts made by ``KVCacheEventSerializer``
(tensorrt_llm/_utils.py): ``{"event_id", "data", "window_size"[, "attention_dp_rank"]}`` with
``data`` one of

- ``{"type": "created", "num_blocks_per_cache_level": [...]}`` (once per window size at start),
- ``{"type": "stored", "parent_hash", "blocks": [{"type": "stored_block", "block_hash",
  "tokens": [{"type": "unique_token", "token_id", "token_extra_id"}], "cache_level", "priority",
  ...}]}``,
- ``{"type": "removed", "block_hashes": [...]}``,
- ``{"type": "updated", "block_hash", "cache_level": {...}, "priority": {...}}``.

``TrtllmEventMapper`` turns them into ``KvEventBatch``es the router's converter understands, with
Dynamo's rules: only the largest attention window is indexed (sliding-window layers report their
own blocks), a stored chain stops at its first partial block (the router hashes full blocks
only) and a later removal of that partial block is not forwarded; ``event_id`` is consecutive, so
a jump (the engine's bounded event buffer overflowed) is a gap. Block hashes are unsigned 64-bit
ints; multimodal token ids (hex strings) cannot be rehashed by the router and end the chain.
A block that covers images lists them in ``mm_keys`` (``{"type": "mm_key", "hash", "start_offset"}``);
they become the event's ``extra_keys`` (``block_mm_keys``), as vLLM publishes them, so the router
keys the block by its images as it keys the prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from dynamod.shared.events.seq import Arrival, EventSequence
from dynamod.shared.protocol.kv_events import BlockRemoved, BlockStored, KvEventBatch, NativeKvEvent

logger = logging.getLogger(__name__)


class TrtllmEventMapper:
    """Stateful: remembers the largest window, partial blocks and the last event id."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.max_window: int | None = None
        self._initial = True  # still in the leading "created" events
        self._partial: set[int] = set()
        # TensorRT-LLM numbers its events; a consumer may join late, so the first id seen is the
        # baseline, and an id that goes back (an engine restart) moves it.
        self._sequence = EventSequence(first=None)

    def gap_before(self, event: Mapping[str, Any]) -> int:
        """Events missing right before ``event`` (0 when consecutive or the first seen)."""
        eid = event.get("event_id")
        if not isinstance(eid, int):
            return 0
        expected = self._sequence.expected
        if self._sequence.observe(eid) is Arrival.GAP and expected is not None:
            return eid - expected
        return 0

    def _dropped_window(self, event: Mapping[str, Any]) -> bool:
        window = event.get("window_size")
        if window is None or self._initial:
            return False
        return self.max_window is not None and window != self.max_window

    def map(self, event: Mapping[str, Any]) -> KvEventBatch | None:
        """One serialized TensorRT-LLM event as a one-event batch (None: nothing to index)."""
        data = event.get("data") or {}
        kind = data.get("type")
        rank = int(event.get("attention_dp_rank") or 0)
        if kind == "created":
            window = event.get("window_size")
            if self._initial and isinstance(window, int):
                self.max_window = window if self.max_window is None else max(self.max_window, window)
            return None
        self._initial = False
        if self._dropped_window(event):
            return None
        native: NativeKvEvent | None = None
        if kind == "stored":
            native = self._stored(data)
        elif kind == "removed":
            hashes = []
            for h in data.get("block_hashes") or []:
                if h is None:
                    continue
                h = int(h)
                if h in self._partial:
                    self._partial.discard(h)
                    continue
                hashes.append(h)
            native = BlockRemoved(block_hashes=hashes, medium="GPU") if hashes else None
        if native is None:
            return None
        return KvEventBatch(ts=time.time(), events=[native], data_parallel_rank=rank)

    def _stored(self, data: Mapping[str, Any]) -> BlockStored | None:
        hashes: list[int] = []
        tokens: list[int] = []
        extra_keys: list[list[Any] | None] = []
        for block in data.get("blocks") or []:
            block_hash = block.get("block_hash")
            block_tokens = block.get("tokens") or []
            if block_hash is None:
                break
            if len(block_tokens) != self.block_size:
                if len(block_tokens) < self.block_size:
                    self._partial.add(int(block_hash))
                else:
                    logger.error("trtllm block larger than the block size tokens=%d block_size=%d",
                                 len(block_tokens), self.block_size)
                break
            ids = [t.get("token_id") for t in block_tokens]
            if not all(isinstance(t, int) for t in ids):
                break  # multimodal placeholder hashes: the router cannot rehash these blocks
            hashes.append(int(block_hash))
            tokens.extend(ids)  # type: ignore[arg-type]
            extra_keys.append(block_mm_keys(block))
        if not hashes:
            return None
        parent = data.get("parent_hash")
        return BlockStored(block_hashes=hashes, parent_block_hash=None if parent is None else int(parent),
                           token_ids=tokens, block_size=self.block_size, lora_id=data.get("lora_id"), medium="GPU",
                           extra_keys=extra_keys if any(extra_keys) else None)


def block_mm_keys(block: Mapping[str, Any]) -> list[Any] | None:
    """A stored block's ``mm_keys`` (``{"type": "mm_key", "hash", "start_offset"}``, one per image the
    block covers, in order) as vLLM-shaped extra keys ``[id, offset]`` (None: no image), which the
    router's converter mixes into the block's key. The id is the request's ``multi_modal_uuids``
    entry, i.e. the frontend's ``mm_hash`` (multimodal.py): the V1 KV cache manager reports it as
    ``hash`` (TensorRT-LLM PR 11075), the V2 one beside its content digest as ``uuid`` (PR 19529)."""
    keys = []
    for key in block.get("mm_keys") or ():
        if not isinstance(key, Mapping) or key.get("type", "mm_key") != "mm_key":
            continue
        ident = key.get("uuid") or key.get("hash")
        if isinstance(ident, str) and ident:
            keys.append([ident, int(key.get("start_offset") or 0)])
    return keys or None
