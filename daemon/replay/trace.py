"""Mooncake-format request traces: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``: each hash
id stands for one block of ``trace_block_size`` prompt tokens (the last block may be partial) and
equal leading ids mean a shared prefix. We turn ids back into token ids deterministically so that
equal ids give equal tokens (and so equal KV block hashes) and different ids never collide.

A request keeps its hash ids, not its tokens: the prompts of a 12k-request trace are 145 million
tokens, over a gigabyte as Python lists. ``TraceRequest.prompt`` builds them when the request
arrives (tens of microseconds), and the replay drops them once the router and the engine have
them. Every hash id is checked when the trace is read, so a built prompt is always in vocabulary.
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
    hash_ids: list[int]
    input_length: int
    output_length: int
    block_size: int  # tokens per hash id
    vocab_size: int

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids, built anew on each call (see the module docstring).

        Each hash id is one block: its first token carries the id's high part (``id //
        vocab_size``), the others its low part. That is unique per id below ``vocab_size**2``;
        the router and the engine chain block hashes by position, so repeated tokens inside a
        block are harmless."""
        hi_lo = [divmod(hid, self.vocab_size) for hid in self.hash_ids]
        tail = self.block_size - 1
        prompt: list[int] = []
        append, extend = prompt.append, prompt.extend
        for hi, lo in hi_lo:
            append(hi)
            extend([lo] * tail)
        del prompt[self.input_length :]  # the last block is partial when input_length is not a multiple
        return prompt


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


def check_hash_id(hash_id: int, vocab_size: int) -> None:
    """Raises ``InvalidRequestError`` for an id whose tokens would fall outside the vocabulary."""
    if hash_id < 0:
        raise InvalidRequestError(f"hash id {hash_id} is negative")
    if hash_id // vocab_size >= vocab_size:
        raise InvalidRequestError(f"hash id {hash_id} is too large for a vocabulary of {vocab_size}")


def build_requests(
    records: list[TraceRecord], *, trace_block_size: int, vocab_size: int, arrival_speedup: float = 1.0
) -> list[TraceRequest]:
    if arrival_speedup <= 0:
        raise InvalidRequestError(f"--arrival-speedup must be positive, got {arrival_speedup}")
    out: list[TraceRequest] = []
    for i, rec in enumerate(records):
        for hid in rec.hash_ids:
            check_hash_id(hid, vocab_size)
        if rec.input_length > len(rec.hash_ids) * trace_block_size:
            raise InvalidRequestError(
                f"record {i}: input_length {rec.input_length} exceeds {len(rec.hash_ids)} blocks of {trace_block_size}"
            )
        out.append(TraceRequest(i, rec.timestamp / arrival_speedup, rec.hash_ids, rec.input_length,
                                rec.output_length, trace_block_size, vocab_size))
    out.sort(key=lambda r: (r.arrival_ms, r.index))
    return out
