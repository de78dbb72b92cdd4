"""vLLM/SGLang native KV event batches -> the router's internal events.

Engine knowledge, kept beside its only user (``native_kv.NativeKvEventQueue``): the router itself only
ever sees the converted events. Engines publish ``KvEventBatch``es (shared/protocol/kv_events.py)
whose block hashes are the engine's own: vLLM's are Python ints or sha256 bytes seeded per
process, SGLang's are ints. The router cannot compute them, so a stored block is rehashed from its
``token_ids`` with the router's local hash (shared/kv/hashing.py; the event's ``block_size``, the
LoRA name salting the seed, and for blocks that cover images the images' ids from the event's
``extra_keys``); the engine hash is kept, as a stable u64, only to match later
removals and parent references.

Every cache tier is indexed as its own medium (``KvStored.medium``/``KvRemoved.medium``): with
offloading, vLLM reports the same block hash on the device and in host memory, and the router keeps
each tier apart (shared/kv/index_tiers.py), so a host-tier removal never erases the device copy. A
converter may still be narrowed to some tiers (``mediums``); events for others are dropped. vLLM's
``AllBlocksCleared`` comes from its device block pool only (the offloading manager resets silently),
so an engine with lower tiers converts it to a device-only clear (``cleared_medium``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import xxhash

from dynamod.shared.kv.hashing import compute_block_hashes, mm_local_hash
from dynamod.shared.protocol.kv_events import (
    MEDIA,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCleared,
    KvEvent,
    KvEventBatch,
    KvRemoved,
    KvStored,
    NativeKvEvent,
    RouterEvent,
    StoredBlock,
)

logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_BYTES_HASH_SEED = 0  # fixed forever: routers and dumps must agree on the conversion


def engine_hash_to_int(block_hash: int | bytes) -> int:
    """A stable u64 for an engine block hash.

    Ints are taken modulo 2**64 (vLLM's builtin-hash mode yields negative values). Bytes (vLLM's
    sha256 modes, possibly with a group id appended) are reduced with ``xxh3_64`` over all of
    their bytes, so two hashes differing only in the tail stay distinct.
    """
    if isinstance(block_hash, int):
        return block_hash & _U64
    return xxhash.xxh3_64_intdigest(bytes(block_hash), _BYTES_HASH_SEED)


def engine_mm_key(block_keys: list[Any] | None) -> bytes:
    """A block's image key (shared/kv/hashing.py ``block_mm_key``) from the engine's extra keys for
    that block: the identifiers of its ``[identifier, offset]`` pairs, in order. The engine's
    identifier is our ``mm_hash`` because the adapter passes it as the image's uuid. Bare entries
    (a LoRA name, which the seed already covers; a cache salt; prompt-embedding digests) are not
    images and are skipped."""
    if not block_keys:
        return b""
    return b"".join(
        key[0].encode("utf-8")
        for key in block_keys
        if isinstance(key, (list, tuple)) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)
    )


def with_engine_mm_keys(local: list[int], extra_keys: list[list[Any] | None], n: int) -> list[int]:
    """Re-keys, in place, the first ``n`` local hashes of a stored event whose blocks cover images,
    as the router keys a prompt's blocks (``hashing.with_mm_keys``), so a cached image matches."""
    for i, block_keys in enumerate(extra_keys[:n]):
        key = engine_mm_key(block_keys)
        if key:
            local[i] = mm_local_hash(local[i], key)
    return local


def medium_of(native_medium: str | None) -> str:
    """An engine's storage medium name as ours (``kv_events.MEDIA``): vLLM says "GPU"/"CPU" (its
    offloading connector's host tier) and "STORAGE" (its file-system tier, the simple offloader's
    disk backend); other disk-backed tiers may say "DISK", "NVME", "SSD" or "LOCAL_DISK"; no medium
    means the device cache."""
    name = (native_medium or MEDIUM_GPU).upper()
    if name in (MEDIUM_GPU, "CUDA", "DEVICE", "HBM"):
        return MEDIUM_GPU
    if name in (MEDIUM_CPU, "HOST", "CPU_PINNED", "HOST_PINNED"):
        return MEDIUM_CPU
    if "DISK" in name or name in ("STORAGE", "NVME", "SSD", "FILE", "LOCAL_FILE"):
        return MEDIUM_DISK
    return name


def _medium_ok(medium: str | None, mediums: frozenset[str]) -> bool:
    return medium_of(medium) in mediums


def convert_native_event(
    event: NativeKvEvent, *, mediums: Iterable[str] = MEDIA, cleared_medium: str | None = None
) -> KvEvent | None:
    """One native event as an internal one; None when it is for a tier not in ``mediums`` or
    unusable. ``AllBlocksCleared`` becomes ``KvCleared(medium=cleared_medium)`` (None: every tier)."""
    accepted = frozenset(medium_of(m) for m in mediums)
    if isinstance(event, BlockStored):
        if not _medium_ok(event.medium, accepted):
            return None
        if event.block_size <= 0:
            # vLLM's offloading connector announces host copies this way (no tokens, no block
            # size) unless its self-describing events are on; the adapter turns them on.
            logger.warning(
                "kv native stored event with bad block_size=%d medium=%s dropped", event.block_size, event.medium
            )
            return None
        local = compute_block_hashes(event.token_ids, event.block_size, event.lora_name)
        n = len(event.block_hashes)
        if len(local) < n:
            # Fewer tokens than blocks: only the blocks whose tokens we have can be matched.
            logger.warning(
                "kv native stored event short of tokens blocks=%d hashable=%d block_size=%d",
                n,
                len(local),
                event.block_size,
            )
            n = len(local)
        if event.extra_keys:
            with_engine_mm_keys(local, event.extra_keys, n)
        blocks = [StoredBlock(engine_hash_to_int(h), local[i]) for i, h in enumerate(event.block_hashes[:n])]
        parent = None if event.parent_block_hash is None else engine_hash_to_int(event.parent_block_hash)
        return KvStored(parent_hash=parent, blocks=blocks, lora_name=event.lora_name, medium=medium_of(event.medium))
    if isinstance(event, BlockRemoved):
        if not _medium_ok(event.medium, accepted):
            return None
        return KvRemoved(block_hashes=[engine_hash_to_int(h) for h in event.block_hashes], medium=medium_of(event.medium))
    if isinstance(event, AllBlocksCleared):
        return KvCleared(medium=cleared_medium)
    raise TypeError(f"not a native KV event: {type(event).__name__}")


class NativeEventConverter:
    """Turns one engine's native batches into numbered router events.

    One converter per worker process: it owns the worker's ``event_id`` sequence (monotonic, no
    gaps, so a router that sees a gap knows it lost events and re-reads ``kv_dump``). Ids are only
    left unused on purpose (``skip``), to make a router notice events the worker lost.
    """

    def __init__(
        self,
        worker_id: int,
        *,
        first_event_id: int = 0,
        mediums: Iterable[str] = MEDIA,
        cleared_medium: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.next_event_id = first_event_id
        self._mediums = tuple(mediums)
        self._cleared_medium = cleared_medium

    def convert(self, batch: KvEventBatch) -> list[RouterEvent]:
        dp_rank = batch.data_parallel_rank or 0
        out: list[RouterEvent] = []
        for native in batch.events:
            event = convert_native_event(native, mediums=self._mediums, cleared_medium=self._cleared_medium)
            if event is None or (isinstance(event, KvStored) and not event.blocks):
                continue
            out.append(self.stamp(dp_rank, event))
        return out

    def stamp(self, dp_rank: int, event: KvEvent) -> RouterEvent:
        """``event`` as the worker's next router event (also for events not from a native batch)."""
        ev = RouterEvent(worker_id=self.worker_id, dp_rank=dp_rank, event_id=self.next_event_id, event=event)
        self.next_event_id += 1
        return ev

    def skip(self) -> int:
        """Leaves the next id unused, so routers see a gap and re-read ``kv_dump``; returns it."""
        self.next_event_id += 1
        return self.next_event_id - 1
