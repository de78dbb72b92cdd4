"""The disk tier's files: one file per KV block, under one directory per data-parallel rank.

A file is ``MAGIC | u32 meta length | msgpack meta | block bytes``; the meta carries what the
router needs to re-learn the block after a restart (its hashes, parent and LoRA) and the block size
in bytes, so files written by a worker with another KV layout are dropped instead of onboarded as
garbage. Files are written to a temporary name and renamed, so a crash leaves no half-written
block behind a valid name. ``DiskStore`` does the file operations synchronously; the tier calls it
only from its I/O thread (``disk_io.py``), never from an engine step.

Persistence (``--disk-cache-persist``): the directory outlives the worker, and at start the files
found there are the tier's contents (oldest written first = least recently used), re-announced as
``KvStored(DISK)``; ``close`` of a persistent tier first finishes its queued writes. Without it the directory is emptied at start and removed at ``close``.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np

from dynamod.daemon.engines.mocker.tier_entry import TierEntry

logger = logging.getLogger(__name__)

MAGIC = b"DKVB\x01"
_HEADER = struct.Struct("<I")
SUFFIX = ".kvb"


class BlockMeta(msgspec.Struct, array_like=True):
    block_hash: int
    tokens_hash: int
    parent_hash: int | None
    lora_name: str | None
    block_bytes: int


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(BlockMeta)


class DiskStore:
    """Block files of one rank's disk tier."""

    def __init__(self, directory: Path | str, block_bytes: int, *, persist: bool) -> None:
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        self.persist = persist
        if not persist and self.directory.exists():
            shutil.rmtree(self.directory)  # a previous run's leftovers, not ours to reuse
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.bytes_written = 0
        self.bytes_read = 0

    def path_of(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}{SUFFIX}"

    def write(self, entry: TierEntry, data: np.ndarray) -> None:
        if data.nbytes != self.block_bytes:
            raise ValueError(f"block {entry.block_hash:x} has {data.nbytes} bytes, the tier holds {self.block_bytes}")
        meta = _meta_encoder.encode(
            BlockMeta(entry.block_hash, entry.tokens_hash, entry.parent_hash, entry.lora_name, self.block_bytes)
        )
        path = self.path_of(entry.block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(_HEADER.pack(len(meta)))
                f.write(meta)
                f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            self._publish(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.bytes_written += self.block_bytes

    def _publish(self, tmp: Path, path: Path) -> None:
        """Gives a fully written file its valid name: the one step a reader (or a restart) can see."""
        os.replace(tmp, path)

    def read(self, block_hash: int) -> np.ndarray:
        with open(self.path_of(block_hash), "rb") as f:
            raw = f.read()
        _, offset = _parse_meta(raw)
        data = np.frombuffer(raw, dtype=np.uint8, offset=offset)
        if data.nbytes != self.block_bytes:
            raise OSError(f"disk KV block {block_hash:x} is truncated ({data.nbytes} of {self.block_bytes} bytes)")
        self.bytes_read += self.block_bytes
        return data

    def delete(self, block_hash: int) -> None:
        try:
            self.path_of(block_hash).unlink()
        except FileNotFoundError:
            pass

    def load_existing(self, capacity: int) -> Iterator[TierEntry]:
        """The blocks a previous run left (persistence), least recently written first; files of
        another layout, unreadable ones and those beyond ``capacity`` are deleted."""
        found: list[tuple[float, Path, BlockMeta]] = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + _HEADER.size)
                    if not head.startswith(MAGIC):
                        raise ValueError("not a KV block file")
                    (n,) = _HEADER.unpack_from(head, len(MAGIC))
                    meta = _meta_decoder.decode(f.read(n))
                size = path.stat().st_size
                if meta.block_bytes != self.block_bytes or size != len(head) + n + self.block_bytes:
                    raise ValueError(f"written for {meta.block_bytes}-byte blocks, this tier holds {self.block_bytes}")
                found.append((path.stat().st_mtime_ns, path, meta))
            except (OSError, ValueError, msgspec.DecodeError) as exc:
                logger.warning("disk kv block dropped path=%s reason=%s", path, exc)
                path.unlink(missing_ok=True)
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found.sort(key=lambda item: item[0])
        if len(found) > capacity:
            for _, path, _ in found[: len(found) - capacity]:
                path.unlink(missing_ok=True)
            found = found[len(found) - capacity:]
        if found:
            logger.info("disk kv blocks restored directory=%s blocks=%d", self.directory, len(found))
        for _, _, meta in found:
            yield TierEntry(meta.block_hash, meta.tokens_hash, meta.parent_hash, meta.lora_name)

    def close(self) -> None:
        if not self.persist:
            shutil.rmtree(self.directory, ignore_errors=True)


def _parse_meta(raw: bytes) -> tuple[BlockMeta, int]:
    if not raw.startswith(MAGIC):
        raise OSError("not a KV block file")
    (n,) = _HEADER.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _HEADER.size
    return _meta_decoder.decode(raw[start:start + n]), start + n
