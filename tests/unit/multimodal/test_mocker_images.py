"""The mocker with images: prefix caching by image content, and the vision encoder's time.

An image is encoded whole in the step that first prefills any of its tokens, at
``encode_ms_per_image_token`` per image token; a fully cached image is not encoded; the KV events
carry the image-keyed hashes the router computes for the same request.
"""

from __future__ import annotations

import pytest

from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvStored
from dynamod.shared.protocol.llm import MultimodalItem, PreprocessedRequest, StopConditions
from tests.unit.mocker.factories import finished_by_request, make_core, run_to_completion

PAD = 99
BS = 4
COST = 0.5  # ms per image token


def request(rid: str, content: str, *, prefix: int = 6, length: int = 16, tail: int = 6) -> PreprocessedRequest:
    tokens = [1 + i for i in range(prefix)] + [PAD] * length + [40 + i for i in range(tail)]
    items = [MultimodalItem(mm_hash=content * 32, offset=prefix, length=length)]
    return PreprocessedRequest(request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=2),
                               mm_items=items)


def serve(core, req: PreprocessedRequest):  # noqa: ANN001, ANN201
    core.add_preprocessed(req)
    outs = run_to_completion(core)
    return finished_by_request(outs)[req.request_id], outs


def test_repeat_image_hits_other_image_misses() -> None:
    core = make_core(num_gpu_blocks=64, block_size=BS, max_num_batched_tokens=256, encode_ms_per_image_token=COST)
    first, outs = serve(core, request("a1", "a"))
    assert first.usage.cached_tokens == 0
    assert sum(o.encode_ms for o in outs) == pytest.approx(16 * COST)
    assert sum(o.num_encoded_image_tokens for o in outs) == 16
    stored = [b.tokens_hash for o in outs for e in o.kv_events if isinstance(e, KvStored) for b in e.blocks]
    req = request("a1", "a")
    assert stored == hash_tokens(req.token_ids, BS, mm_items=req.mm_items)[0][: len(stored)]

    again, outs = serve(core, request("a2", "a"))
    assert again.usage.cached_tokens == 24  # every full block: the 28-token prompt's 7 blocks, less the last
    assert sum(o.encode_ms for o in outs) == 0.0  # the image's tokens are all cached: nothing to encode

    other, outs = serve(core, request("b1", "b"))
    assert other.usage.cached_tokens == 4  # block 0 only: block 1 holds the first image tokens
    assert sum(o.encode_ms for o in outs) == pytest.approx(16 * COST)


def test_chunked_prefill_encodes_each_image_once_in_its_first_chunk() -> None:
    core = make_core(num_gpu_blocks=64, block_size=BS, max_num_batched_tokens=8, encode_ms_per_image_token=COST)
    _, outs = serve(core, request("c", "c", prefix=6, length=16, tail=6))
    encoded = [(o.num_prefill_tokens, o.num_encoded_image_tokens) for o in outs if o.num_prefill_tokens]
    assert encoded[0] == (8, 16)  # tokens 0..7 reach the image at 6: all 16 of its tokens are encoded
    assert all(n == 0 for _, n in encoded[1:])
    steps = [o for o in outs if o.encode_ms]
    assert len(steps) == 1 and steps[0].duration_ms == pytest.approx(steps[0].encode_ms + steps[0].prefill_ms)


def test_partly_cached_image_is_encoded_whole() -> None:
    core = make_core(num_gpu_blocks=64, block_size=BS, max_num_batched_tokens=256, encode_ms_per_image_token=COST)
    serve(core, request("x", "x", length=16, tail=6))
    # The same image key over fewer tokens: its first two image blocks (tokens 4..11) are cached,
    # the rest is not; the prefill starts inside the image, which is still encoded whole.
    short, outs = serve(core, request("y", "x", length=8, tail=14))
    assert short.usage.cached_tokens == 12
    assert sum(o.num_encoded_image_tokens for o in outs) == 8


def test_no_encode_cost_without_images_and_flag_checked() -> None:
    core = make_core(num_gpu_blocks=64, block_size=BS, encode_ms_per_image_token=COST)
    core.add_request("t", list(range(1, 30)), max_tokens=2)
    assert all(o.encode_ms == 0.0 for o in run_to_completion(core))
    with pytest.raises(ValueError, match="--encode-ms-per-image-token"):
        make_core(encode_ms_per_image_token=-1.0)
