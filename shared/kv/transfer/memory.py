"""``KvBlockMemory``: one worker's KV cache as a byte array, ``num_blocks`` rows of ``block_bytes``.

A real engine's KV cache is device memory the transfer agent registers; the mocker keeps the same
bytes in host memory (numpy, so NIXL can register the buffer by address and a TCP send can use
the rows without copying). ``np.zeros`` maps pages lazily: memory that no block has been written
to costs nothing, so a large cache of a small model is cheap until it fills.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from dynamod.shared.kv.transfer.readiness import BlockReadiness


class KvBlockMemory:
    """Block-addressed host memory. Block ids index rows; rows are contiguous and C-ordered.
    ``readiness``: the transfers whose rows are still being computed (streamed to readers)."""

    __slots__ = ("num_blocks", "block_bytes", "array", "readiness")

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(f"KV memory needs positive sizes, got {num_blocks} blocks of {block_bytes} bytes")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.array = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        self.readiness = BlockReadiness()

    @property
    def base_address(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def address_of(self, block_id: int) -> int:
        return self.base_address + block_id * self.block_bytes

    def block(self, block_id: int) -> memoryview:
        """The block's bytes, writable, without a copy."""
        return memoryview(self.array[block_id])

    def check_ids(self, block_ids: Sequence[int]) -> None:
        n = self.num_blocks
        for b in block_ids:
            if not 0 <= b < n:
                raise ValueError(f"block id {b} is outside [0, {n})")

    def checksum(self, block_ids: Sequence[int]) -> int:
        """xxh3_64 over the bytes of ``block_ids`` in order (what ``KvTransferParams.checksum`` holds)."""
        h = xxhash.xxh3_64()
        for b in block_ids:
            h.update(self.array[b].data)
        return h.intdigest()
