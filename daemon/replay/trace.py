"""Mooncake-format request traces: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``: each hash
id stands for one block of ``trace_block_size`` prompt tokens (the last block may be partial) and
equal leading ids mean a shared prefix. We turn ids back into token ids deterministically so that
equal ids give equal tokens (and so equal KV block hashes) and different ids never collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamod.shared.errors import InvalidRequestError


class TraceRecord(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class TraceRequest:
    index: int
    arrival_ms: float
    prompt: list[int]
    output_length: int


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Reads and validates a trace; a bad line gives its line number."""
    decoder = msgspec.json.Decoder(TraceRecord)
    records: list[TraceRecord] = []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read trace {path}: {exc.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidRequestError(f"{path}:{lineno}: not a trace record: {exc}") from None
        if rec.input_length < 1 or rec.output_length < 1 or not rec.hash_ids:
            raise InvalidRequestError(f"{path}:{lineno}: input_length, output_length and hash_ids must be non-empty")
        records.append(rec)
    if not records:
        raise InvalidRequestError(f"trace {path} has no requests")
    return records


def block_tokens(hash_id: int, block_size: int, vocab_size: int) -> list[int]:
    """The tokens standing for one trace block: unique per hash id for ids below vocab_size**2.

    The first token carries the id's high part and the rest its low part; the router and engine
    chain block hashes by position, so repeated tokens inside a block are harmless.
    """
    hi, lo = divmod(hash_id, vocab_size)
    if hi >= vocab_size:
        raise InvalidRequestError(f"hash id {hash_id} is too large for a vocabulary of {vocab_size}")
    return [hi] + [lo] * (block_size - 1)


def build_requests(
    records: list[TraceRecord], *, trace_block_size: int, vocab_size: int, arrival_speedup: float = 1.0
) -> list[TraceRequest]:
    if arrival_speedup <= 0:
        raise InvalidRequestError(f"--arrival-speedup must be positive, got {arrival_speedup}")
    cache: dict[int, list[int]] = {}
    out: list[TraceRequest] = []
    for i, rec in enumerate(records):
        prompt: list[int] = []
        for hid in rec.hash_ids:
            block = cache.get(hid)
            if block is None:
                block = cache[hid] = block_tokens(hid, trace_block_size, vocab_size)
            prompt.extend(block)
        # The last block is partial when input_length is not a multiple of the block size.
        del prompt[rec.input_length :]
        if len(prompt) < rec.input_length:
            raise InvalidRequestError(
                f"record {i}: input_length {rec.input_length} exceeds {len(rec.hash_ids)} blocks of {trace_block_size}"
            )
        out.append(TraceRequest(i, rec.timestamp / arrival_speedup, prompt, rec.output_length))
    out.sort(key=lambda r: (r.arrival_ms, r.index))
    return out
