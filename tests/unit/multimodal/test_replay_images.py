"""``dynamod replay`` with images: trace records carry images (offset, tokens or size, content id);
a repeated image is a cache hit through its blocks, another image at the same place a miss, and
the encoder's time is in the TTFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamod.daemon.perf.mocker_timing import prefill_time_ms
from dynamod.daemon.replay.simulator import replay
from dynamod.daemon.replay.trace import TraceImage, TraceRecord, build_requests, load_trace
from dynamod.shared.errors import InvalidRequestError
from tests.unit.replay.helpers import BLOCK, VOCAB, mocker

IDS = [101, 102, 103, 104, 105, 106]  # six blocks: 96 prompt tokens
COST = 0.1


def trace(*image_ids: int | None) -> list:
    records = []
    for i, image_id in enumerate(image_ids):
        images = None if image_id is None else [TraceImage(offset=20, tokens=40, id=image_id)]
        records.append(TraceRecord(i * 1000.0, len(IDS) * BLOCK, 3, IDS, images))
    return build_requests(records, trace_block_size=BLOCK, vocab_size=VOCAB)


def test_repeat_image_hits_other_image_misses_and_encoding_costs() -> None:
    cfg = mocker(encode_ms_per_image_token=COST)
    same = replay(trace(7, 7), workers=1, mode="kv", mocker=cfg)
    other = replay(trace(7, 8), workers=1, mode="kv", mocker=cfg)
    # Same image: the repeat hits 5 of 6 blocks (the last is recomputed); another image: only
    # block 0 (tokens 0..15) precedes the image at 20..59, and the blocks after it follow it.
    assert same["cache_hit_rate"] == pytest.approx(80 / 192, abs=1e-4)
    assert other["cache_hit_rate"] == pytest.approx(16 / 192, abs=1e-4)
    first_ttft = 40 * COST + prefill_time_ms(96)
    assert same["ttft_ms"]["mean"] == pytest.approx((first_ttft + prefill_time_ms(16)) / 2, abs=1e-3)
    assert other["ttft_ms"]["mean"] == pytest.approx((first_ttft + 40 * COST + prefill_time_ms(80)) / 2, abs=1e-3)
    # Without images the same trace is a text prompt: the placeholders become the trace's tokens.
    text = replay(trace(None, None), workers=1, mode="kv", mocker=cfg)
    assert text["cache_hit_rate"] == pytest.approx(80 / 192, abs=1e-4)


def test_image_records_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mm.jsonl"
    rows = [{"timestamp": 0, "input_length": 96, "output_length": 2, "hash_ids": IDS,
             "images": [{"offset": 10, "width": 224, "height": 224, "id": "cat"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = build_requests(load_trace(path), trace_block_size=BLOCK, vocab_size=VOCAB)
    (item,) = reqs[0].images or []
    assert (item.offset, item.length, item.mm_hash) == (10, 64, "trace-image-cat")  # Qwen2-VL: 224 px -> 64 tokens
    assert set(reqs[0].prompt[10:74]) == {VOCAB - 1}
    bad = TraceRecord(0.0, 96, 2, IDS, [TraceImage(offset=90, tokens=40, id=1)])
    with pytest.raises(InvalidRequestError, match="must lie within the 96-token prompt"):
        build_requests([bad], trace_block_size=BLOCK, vocab_size=VOCAB)
    sizeless = TraceRecord(0.0, 96, 2, IDS, [TraceImage(offset=0, id=1)])
    with pytest.raises(InvalidRequestError, match="needs 'tokens' or 'width' and 'height'"):
        build_requests([sizeless], trace_block_size=BLOCK, vocab_size=VOCAB)
