"""KV identity of images (shared/kv/hashing.py): blocks covering an image are keyed by its content.

Text-only prompts must hash exactly as before (the router, the workers and every recorded trace
rely on it); a block with image tokens must differ between two images of the same size, equal for
the same image; and the mocker, which hashes generated tokens block by block as they complete,
must give the router's hashes for the same tokens and images.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.engines.mocker.request import MockRequest
from dynamod.shared.kv.hashing import (
    block_mm_key,
    compute_block_hashes,
    compute_block_hashes_py,
    compute_sequence_hashes,
    hash_tokens,
    mm_local_hash,
)
from dynamod.shared.protocol.llm import MultimodalItem, PreprocessedRequest

PAD = 99


def image(offset: int, length: int, content: str) -> MultimodalItem:
    return MultimodalItem(mm_hash=content * 16, offset=offset, length=length)


def prompt_with(offset: int, length: int, total: int) -> list[int]:
    return [i % 50 for i in range(offset)] + [PAD] * length + [i % 50 for i in range(total - offset - length)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=120), st.sampled_from([1, 4, 16]))
def test_text_only_hashes_are_unchanged(tokens: list[int], block_size: int) -> None:
    plain = hash_tokens(tokens, block_size)
    assert hash_tokens(tokens, block_size, None, None) == plain
    assert hash_tokens(tokens, block_size, None, []) == plain
    assert plain[0] == compute_block_hashes_py(tokens, block_size)


def test_only_blocks_covering_the_image_change() -> None:
    bs = 4
    tokens = prompt_with(6, 9, 24)  # image tokens 6..14: blocks 1, 2, 3
    text_local, _ = hash_tokens(tokens, bs)
    a_local, a_seq = hash_tokens(tokens, bs, mm_items=[image(6, 9, "a")])
    b_local, b_seq = hash_tokens(tokens, bs, mm_items=[image(6, 9, "b")])
    assert a_local[0] == b_local[0] == text_local[0]
    assert a_local[4:] == b_local[4:] == text_local[4:]  # tokens after the image: same local hashes...
    assert a_seq[4:] != b_seq[4:]  # ...but their chained hashes follow the image
    for i in (1, 2, 3):
        assert a_local[i] != b_local[i] and a_local[i] != text_local[i]
    assert hash_tokens(tokens, bs, mm_items=[image(6, 9, "a")]) == (a_local, a_seq)  # deterministic
    # The definition: LE64(text local hash) ++ the overlapping images' hashes, in order.
    assert a_local[2] == mm_local_hash(text_local[2], ("a" * 16).encode())


def test_block_shared_by_two_images_carries_both_in_order() -> None:
    items = [image(2, 3, "a"), image(5, 2, "b")]  # block 1 (tokens 4..7) holds the end of a and all of b
    assert block_mm_key(0, 4, items) == b"a" * 16
    assert block_mm_key(1, 4, items) == b"a" * 16 + b"b" * 16
    assert block_mm_key(2, 4, items) == b""
    swapped = [image(2, 3, "b"), image(5, 2, "a")]
    assert hash_tokens(prompt_with(2, 5, 12), 4, mm_items=items) != hash_tokens(prompt_with(2, 5, 12), 4, mm_items=swapped)


def test_partial_tail_is_not_hashed_and_empty_items_change_nothing() -> None:
    tokens = prompt_with(5, 3, 8)
    assert len(hash_tokens(tokens, 16, mm_items=[image(5, 3, "a")])[0]) == 0
    assert hash_tokens(tokens, 4, mm_items=[image(5, 0, "a")]) == hash_tokens(tokens, 4)


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 30), length=st.integers(1, 20), tail=st.integers(0, 30), generated=st.integers(0, 20),
       block_size=st.sampled_from([4, 16]))
def test_mocker_blocks_match_the_router(offset: int, length: int, tail: int, generated: int, block_size: int) -> None:
    """A prompt's blocks at admission and the blocks generation completes later (an image may end
    in the prompt's partial last block) equal the router's hash of the whole sequence."""
    prompt = prompt_with(offset, length, offset + length + tail)
    items = [image(offset, length, "c")]
    request = MockRequest("r", prompt, max_output_tokens=64, vocab_size=100)
    request.mm_items = items
    request.hash_prompt(block_size)
    request.append_plain_tokens(generated)
    n = len(request.token_ids) // block_size
    request.ensure_block_hashes(n, block_size)
    local, seq = hash_tokens(request.token_ids, block_size, mm_items=items)
    assert request.local_hashes == local and request.block_hashes == seq


def test_native_and_python_agree_with_images() -> None:
    tokens = prompt_with(10, 40, 80)
    local = compute_block_hashes(tokens, 16)
    assert local == compute_block_hashes_py(tokens, 16)
    a = hash_tokens(tokens, 16, mm_items=[image(10, 40, "d")])
    assert a[1] == compute_sequence_hashes(a[0])


def test_wire_roundtrip_and_text_requests_unchanged() -> None:
    req = PreprocessedRequest(request_id="r", model="m", token_ids=[1, PAD, PAD, 2],
                              mm_items=[MultimodalItem(mm_hash="ab" * 16, offset=1, length=2, width=28, height=56)])
    wire = msgspec.msgpack.encode(req)
    assert msgspec.msgpack.decode(wire, type=PreprocessedRequest) == req
    text = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2])
    assert b"mm_items" not in msgspec.msgpack.encode(text)  # omitted: old workers see the same bytes
