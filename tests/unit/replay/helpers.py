"""Tiny hand-made traces and a small engine, so replay figures can be reasoned out by hand."""

from __future__ import annotations

import json
from pathlib import Path

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.replay.trace import TraceRecord, TraceRequest, build_requests

VOCAB = 32000
BLOCK = 16  # engine block size, and tokens per trace hash id: one trace id is one KV block


def mocker(**overrides: object) -> MockerConfig:
    """256 blocks of 16 tokens, no watermark: room for every test trace, no preemption."""
    knobs: dict[str, object] = dict(
        num_gpu_blocks=256, block_size=BLOCK, max_num_seqs=16, max_num_batched_tokens=2048, watermark=0.0, vocab_size=VOCAB,
    )
    knobs.update(overrides)
    return MockerConfig(**knobs)  # type: ignore[arg-type]


def requests(*rows: tuple[float, list[int], int]) -> list[TraceRequest]:
    """``(arrival_ms, hash_ids, output_length)`` rows; each prompt is whole blocks of its ids."""
    records = [TraceRecord(t, len(ids) * BLOCK, out, ids) for t, ids, out in rows]
    return build_requests(records, trace_block_size=BLOCK, vocab_size=VOCAB)


def mixed_trace(n: int = 60) -> list[TraceRequest]:
    """A busier trace: shared prefixes, varied lengths, overlapping arrivals."""
    rows = []
    for i in range(n):
        prefix = [1000 + (i % 3) * 10 + k for k in range(4)]  # three families sharing 4 blocks
        own = [10_000 + i * 100 + k for k in range(2 + (i * 7) % 11)]
        rows.append((i * 15.0, prefix + own, 5 + (i * 13) % 30))
    return requests(*rows)


def ragged_trace(n: int = 60) -> list[TraceRequest]:
    """``mixed_trace`` with prompts that end inside a block (as real ones do): a prompt's first
    decode steps then fill its last block before taking a new one."""
    records = []
    for i in range(n):
        ids = [1000 + (i % 3) * 10 + k for k in range(4)] + [10_000 + i * 100 + k for k in range(2 + (i * 7) % 11)]
        records.append(TraceRecord(i * 15.0, len(ids) * BLOCK - (i * 5) % BLOCK, 5 + (i * 13) % 30, ids))
    return build_requests(records, trace_block_size=BLOCK, vocab_size=VOCAB)


def write_trace(path: Path, rows: list[tuple[float, list[int], int]]) -> Path:
    """The same rows as a Mooncake JSONL file, for the CLI."""
    with path.open("w") as fh:
        for t, ids, out in rows:
            fh.write(json.dumps({"timestamp": t, "input_length": len(ids) * BLOCK, "output_length": out, "hash_ids": ids}) + "\n")
    return path
