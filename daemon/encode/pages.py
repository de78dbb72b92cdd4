"""Embedding memory: pages of ``EMBEDDING_PAGE_TOKENS`` tokens in a ``KvBlockMemory``.

Both ends of an embedding transfer keep embeddings this way: the encode worker writes each image's
embedding into pages it holds until the reader's notification, the prefill/agg worker reads them
into pages of its own (its embedding cache). Using the KV transfer layer's block memory means NIXL
or the TCP block transport moves an embedding exactly as it moves KV blocks.

The embedding bytes of the mocker's encoder are derived from the image's content hash
(``mock_embedding``), so a reader can tell a right transfer from a wrong one by content, not only
by the checksum the sender computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.encode import EMBEDDING_DTYPE_BYTES, EMBEDDING_PAGE_TOKENS


def page_bytes(hidden_size: int, page_tokens: int = EMBEDDING_PAGE_TOKENS) -> int:
    """Bytes of one page: ``page_tokens`` embeddings of ``hidden_size`` bf16 values."""
    return page_tokens * hidden_size * EMBEDDING_DTYPE_BYTES


def pages_for(num_bytes: int, block_bytes: int) -> int:
    return -(-num_bytes // block_bytes)


def mock_embedding(mm_hash: str, num_tokens: int, hidden_size: int) -> bytes:
    """The mocker encoder's output for an image: ``num_tokens x hidden_size`` bf16 values, a pure
    function of the content hash (the same image gives the same bytes on every encode worker)."""
    seed = int(mm_hash[:16], 16) if mm_hash else 0
    n = num_tokens * hidden_size * EMBEDDING_DTYPE_BYTES
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


class EmbeddingPages:
    """A page allocator over one ``KvBlockMemory`` (the memory the transfer agent registers)."""

    def __init__(self, num_pages: int, block_bytes: int) -> None:
        self.memory = KvBlockMemory(num_pages, block_bytes)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def block_bytes(self) -> int:
        return self.memory.block_bytes

    @property
    def num_pages(self) -> int:
        return self.memory.num_blocks

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages, or None when fewer are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)

    def write(self, ids: Sequence[int], data: bytes) -> None:
        """``data`` across ``ids`` in order; the last page's tail is zeroed (it is checksummed)."""
        bb = self.block_bytes
        if len(data) > len(ids) * bb:
            raise ValueError(f"{len(data)} bytes do not fit in {len(ids)} pages of {bb}")
        view = memoryview(data)
        for i, page in enumerate(ids):
            chunk = view[i * bb:(i + 1) * bb]
            row = self.memory.array[page]
            row[:len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            if len(chunk) < bb:
                row[len(chunk):] = 0

    def read(self, ids: Sequence[int], num_bytes: int) -> bytes:
        """The first ``num_bytes`` of ``ids`` in order."""
        out = b"".join(self.memory.array[p].tobytes() for p in ids)
        return out[:num_bytes]

    def checksum(self, ids: Sequence[int]) -> int:
        return self.memory.checksum(ids)
