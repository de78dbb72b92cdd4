"""The bytes a mocker writes into its KV blocks: deterministic, derived from the tokens they hold.

A disaggregated mocker moves real KV bytes between workers, and a test proves that the bytes a
decode worker received are the bytes the prefill worker computed (a checksum). That needs contents
that depend on the tokens, the same on every worker, and cheap to make. Each token slot of a block
(``bytes_per_token`` bytes, as a real engine's K and V for every layer) is a fixed pseudo-random
pattern XORed with a 64-bit value of the token's context:

    v(t) = splitmix64(parent ^ sum_{j<=t} (token_j + 1) * W^(j+1))     (j, t: positions in the block)

where ``parent`` is the router's sequence hash of the previous block (the LoRA seed for block 0).
So a slot depends on every token before it, as attention's KV does, two prompts sharing a prefix
share those blocks' bytes exactly (a prefix-cache hit holds the same bytes a transfer would bring),
and writing a block is a handful of numpy operations over it. The pattern comes from a fixed seed,
so any two workers with the same layout produce the same bytes.
"""

from __future__ import annotations

import numpy as np

from dynamod.daemon.engines.mocker.request import MockRequest
from dynamod.shared.kv.hashing import seed_for_lora
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_transfer import KvLayout

_PATTERN_SEED = 0x6B76_636F_6E74  # "kvcont": the same on every worker
_W = 0x9E37_79B9_7F4A_7C15
_M1 = np.uint64(0xBF58_476D_1CE4_E5B9)
_M2 = np.uint64(0x94D0_49BB_1331_11EB)
_GOLDEN = np.uint64(_W)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)
_MASK64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


class KvContentWriter:
    """Writes the KV bytes of one data-parallel rank's blocks into a shared ``KvBlockMemory``.

    Block ``b`` of this rank is row ``row_offset + b`` of the memory (one memory per worker, the
    ranks one after the other, so one transfer agent serves every rank)."""

    __slots__ = ("memory", "block_size", "bytes_per_token", "row_offset", "_words", "_pattern", "_weights", "_aligned")

    def __init__(self, memory: KvBlockMemory, layout: KvLayout, row_offset: int = 0) -> None:
        if memory.block_bytes != layout.block_bytes:
            raise ValueError(f"memory rows of {memory.block_bytes} bytes do not hold blocks of {layout.block_bytes}")
        self.memory = memory
        self.block_size = layout.block_size
        self.bytes_per_token = layout.bytes_per_token
        self.row_offset = row_offset
        self._words = -(-self.bytes_per_token // 8)
        self._pattern = np.random.default_rng(_PATTERN_SEED).integers(0, 2**64, self._words, dtype=np.uint64, endpoint=False)
        weights, w = [], 1
        for _ in range(self.block_size):
            w = (w * _W) & _MASK64
            weights.append(w)
        self._weights = np.array(weights, dtype=np.uint64)
        self._aligned = self.bytes_per_token % 8 == 0

    def row(self, block_id: int) -> int:
        return self.row_offset + block_id

    def write(self, request: MockRequest, start: int, end: int) -> None:
        """Writes the slots of tokens ``[start, end)`` of ``request`` (just computed), redoing
        the earlier slots of ``start``'s block: a slot depends on the block's tokens before it."""
        bs = self.block_size
        first = start // bs
        last = (end - 1) // bs
        if last:
            request.ensure_block_hashes(last, bs)
        hashes = request.block_hashes
        tokens = request.token_ids
        blocks = request.blocks
        lora_seed = seed_for_lora(request.lora_name) if request.lora_name else 0
        for i in range(first, last + 1):
            lo = i * bs
            hi = min(lo + bs, end)
            parent = hashes[i - 1] if i else lora_seed
            self._write_block(self.row_offset + blocks[i].block_id, tokens[lo:hi], parent)

    def _write_block(self, row: int, tokens: list[int], parent: int) -> None:
        n = len(tokens)
        context = np.cumsum((np.array(tokens, dtype=np.uint64) + _ONE) * self._weights[:n])
        context ^= np.uint64(parent)
        values = _splitmix64(context)
        bpt = self.bytes_per_token
        dest = self.memory.array[row, : n * bpt]
        if self._aligned:
            np.bitwise_xor(self._pattern, values[:, None], out=dest.view(np.uint64).reshape(n, self._words))
        else:
            words = self._pattern ^ values[:, None]
            dest.reshape(n, bpt)[:] = words.view(np.uint8).reshape(n, self._words * 8)[:, :bpt]
