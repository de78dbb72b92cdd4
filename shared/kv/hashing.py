"""Block hashing shared by the router and the mocker (DESIGN.md "Block hashing").

Each full block of ``block_size`` tokens is hashed as its tokens in little-endian u32 with
``xxh3_64(bytes, seed)``; the seed is 1337, or a seed derived from the LoRA name for adapter
requests so that adapters never share cache entries with the base model. The chained (sequence)
hash of block i is ``xxh3_64(LE64(seq[i-1]) ++ LE64(local[i]), 1337)`` and block 0's sequence hash
is its local hash. A trailing partial block is not hashed.

Images (multimodal prompts): an image's placeholder tokens are the same token id repeated, so two
different images of the same size give the same tokens. As vLLM's prefix cache puts the images'
content hashes in a block's "extra keys", the local hash of every block that covers some of an
image's placeholder tokens becomes ``xxh3_64(LE64(tokens_local) ++ keys, 1337)``, ``keys`` being
the content hashes (``mm_hash``, UTF-8) of the images it overlaps, in prompt order. Blocks with no
image tokens, and so every text-only prompt, hash exactly as above.

This sits on the router's hot path (an 8k-token prompt is hashed on every routing decision within
a 1 ms budget; a 32k-token one in four times that): when the compiled KV core is in use
(shared/kv/native.py) a whole prompt is hashed in one C call, ~20x faster than the Python loops.
The pure-Python versions (``*_py``) stay as the fallback and the reference; they bind their
callables locally, pass the seed positionally and pack the chained pair with a precompiled
``struct``. Both give the same values as the plain definitions above
(tests/unit/router/test_hashing_reference.py checks each against them).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

import xxhash

from dynamod.shared.kv import native

KV_HASH_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"
_PACK_PAIR = struct.Struct("<QQ").pack  # explicit little-endian, whatever the host order
_PACK_ONE = struct.Struct("<Q").pack
assert array("I").itemsize == 4


@lru_cache(maxsize=4096)
def seed_for_lora(lora_name: str | None) -> int:
    """The xxh3 seed for a request: 1337 for the base model, a per-adapter seed otherwise."""
    if not lora_name:
        return KV_HASH_SEED
    return _xxh3(lora_name.encode("utf-8"), KV_HASH_SEED)


def _u32_le_bytes(tokens: Sequence[int]) -> bytes:
    buf = array("I", tokens)
    if not _LITTLE:
        buf.byteswap()
    return buf.tobytes()


def compute_block_hashes_py(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Local hashes of every full block of ``tokens`` (the partial tail is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(tokens) // block_size
    if n_full == 0:
        return []
    end = n_full * block_size
    data = _u32_le_bytes(tokens if end == len(tokens) else tokens[:end])
    step = block_size * 4
    seed = seed_for_lora(lora_name)
    xxh3 = _xxh3
    # Slicing bytes (a 64-byte copy for block 16) is cheaper than building memoryview slices.
    return [xxh3(data[i : i + step], seed) for i in range(0, n_full * step, step)]


def chain_hash(parent: int, local: int) -> int:
    """Sequence hash of a block given its parent's sequence hash and its own local hash."""
    return _xxh3(_PACK_PAIR(parent, local), KV_HASH_SEED)


def compute_sequence_hashes_py(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Chained hashes for consecutive blocks; ``parent`` continues an existing chain."""
    if not local_hashes:
        return []
    xxh3 = _xxh3
    pack = _PACK_PAIR
    seed = KV_HASH_SEED
    it = iter(local_hashes)
    prev = next(it) if parent is None else xxh3(pack(parent, next(it)), seed)
    out = [prev]
    append = out.append
    for local in it:
        prev = xxh3(pack(prev, local), seed)
        append(prev)
    return out


def _compute_block_hashes_native(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Local hashes of every full block of ``tokens`` (the partial tail is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _block_hashes_c(tokens, block_size, seed_for_lora(lora_name))


def _compute_sequence_hashes_native(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Chained hashes for consecutive blocks; ``parent`` continues an existing chain."""
    return _sequence_hashes_c(local_hashes, parent)


if native.core is not None:
    _block_hashes_c = native.core.block_hashes
    _sequence_hashes_c = native.core.sequence_hashes
    compute_block_hashes = _compute_block_hashes_native
    compute_sequence_hashes = _compute_sequence_hashes_native
else:
    compute_block_hashes = compute_block_hashes_py
    compute_sequence_hashes = compute_sequence_hashes_py


class MultimodalSpan(Protocol):
    """Where an image's placeholder tokens are in a prompt and what the image is
    (``shared.protocol.llm.MultimodalItem`` is one)."""

    mm_hash: str
    offset: int
    length: int


def block_mm_key(block_index: int, block_size: int, items: Sequence[MultimodalSpan]) -> bytes:
    """The content hashes of the images whose placeholder tokens overlap block ``block_index``,
    joined in prompt order; empty for a block with no image tokens."""
    lo = block_index * block_size
    hi = lo + block_size
    return b"".join(
        item.mm_hash.encode("utf-8") for item in items if item.length > 0 and item.offset < hi and item.offset + item.length > lo
    )


def mm_local_hash(local: int, key: bytes) -> int:
    """A block's local hash with its images' key mixed in (``key`` empty: unchanged)."""
    return _xxh3(_PACK_ONE(local) + key, KV_HASH_SEED) if key else local


def with_mm_keys(local: list[int], block_size: int, items: Sequence[MultimodalSpan] | None) -> list[int]:
    """``local`` (the text hashes of consecutive full blocks from block 0) with every block that
    covers image tokens re-keyed by ``mm_local_hash``; changes the list in place and returns it."""
    if not items:
        return local
    n = len(local)
    touched: set[int] = set()
    for item in items:
        if item.length <= 0:
            continue
        first = item.offset // block_size
        last = min((item.offset + item.length - 1) // block_size, n - 1)
        touched.update(range(first, last + 1))
    for i in sorted(touched):
        local[i] = mm_local_hash(local[i], block_mm_key(i, block_size, items))
    return local


def hash_tokens(
    tokens: Sequence[int], block_size: int, lora_name: str | None = None, mm_items: Sequence[MultimodalSpan] | None = None
) -> tuple[list[int], list[int]]:
    """(local hashes, sequence hashes) of the full blocks of ``tokens``; ``mm_items``: the
    prompt's images, whose content hashes key the blocks that cover them."""
    local = compute_block_hashes(tokens, block_size, lora_name)
    if mm_items:
        with_mm_keys(local, block_size, mm_items)
    return local, compute_sequence_hashes(local)
