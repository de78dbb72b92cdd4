"""One block held in a lower KV tier (host memory or disk): the record the tier index
(``tiers.py``), the disk files (``disk_tier.py``) and the disk I/O thread (``disk_io.py``) all pass
around. It sits below those three so that none of them imports another just for this type."""

from __future__ import annotations

import numpy as np


class TierEntry:
    """One block in a lower tier: its identity (for events and lookups) and, in the host tier of a
    core that keeps bytes, a copy of its contents."""

    __slots__ = ("block_hash", "tokens_hash", "parent_hash", "lora_name", "data")

    def __init__(
        self, block_hash: int, tokens_hash: int, parent_hash: int | None, lora_name: str | None,
        data: np.ndarray | None = None,
    ) -> None:
        self.block_hash = block_hash
        self.tokens_hash = tokens_hash
        self.parent_hash = parent_hash
        self.lora_name = lora_name
        self.data = data

    def __repr__(self) -> str:
        return f"TierEntry(hash={self.block_hash})"
