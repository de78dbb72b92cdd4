"""The optimized block hashing, pure Python and compiled, gives exactly DESIGN.md's definition
(hypothesis)."""

from __future__ import annotations

import struct

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import given, settings

from dynamod.shared.kv.hashing import (
    KV_HASH_SEED,
    chain_hash,
    compute_block_hashes,
    compute_block_hashes_py,
    compute_sequence_hashes,
    compute_sequence_hashes_py,
    hash_tokens,
    seed_for_lora,
)
from tests.unit.router.kv_impls import IMPLS, NATIVE_CORE


def implementation(impl: str):
    """(block hashes, sequence hashes) functions of one implementation, whatever is selected."""
    if impl == "python":
        return compute_block_hashes_py, compute_sequence_hashes_py

    def blocks(tokens, block_size, lora=None):
        return NATIVE_CORE.block_hashes(tokens, block_size, seed_for_lora(lora))

    return blocks, NATIVE_CORE.sequence_hashes


def reference(tokens: list[int], block_size: int, lora: str | None) -> tuple[list[int], list[int]]:
    """DESIGN.md "Block hashing", written the slow and obvious way."""
    seed = KV_HASH_SEED if not lora else xxhash.xxh3_64(lora.encode(), seed=KV_HASH_SEED).intdigest()
    local = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = b"".join(struct.pack("<I", t) for t in block)
        local.append(xxhash.xxh3_64(data, seed=seed).intdigest())
    seq = []
    for i, h in enumerate(local):
        seq.append(h if i == 0 else xxhash.xxh3_64(struct.pack("<Q", seq[-1]) + struct.pack("<Q", h), seed=KV_HASH_SEED).intdigest())
    return local, seq


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 3, 16, 32]),
    lora=st.sampled_from([None, "", "sql-adapter"]),
    as_tuple=st.booleans(),
)
def test_matches_the_reference(impl, tokens, block_size, lora, as_tuple):
    data = tuple(tokens) if as_tuple else tokens
    local, seq = reference(tokens, block_size, lora)
    block_hashes, sequence_hashes = implementation(impl)
    assert block_hashes(data, block_size, lora) == local
    assert sequence_hashes(local) == seq
    if len(local) > 2:
        assert sequence_hashes(local[2:], seq[1]) == seq[2:]
    # What the router calls, whichever implementation is selected.
    assert compute_block_hashes(data, block_size, lora) == local
    assert compute_sequence_hashes(local) == seq
    assert hash_tokens(data, block_size, lora) == (local, seq)
    if len(local) > 2:
        assert compute_sequence_hashes(local[2:], parent=seq[1]) == seq[2:]
        assert chain_hash(seq[0], local[1]) == seq[1]
    assert seed_for_lora(lora) == (KV_HASH_SEED if not lora else reference_seed(lora))


def reference_seed(lora: str) -> int:
    return xxhash.xxh3_64(lora.encode(), seed=KV_HASH_SEED).intdigest()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("tokens", "error"),
    [([-1] * 4, OverflowError), ([2**32] * 4, OverflowError), ([1.5] * 4, TypeError), (None, TypeError)],
)
def test_bad_token_ids_are_refused_alike(impl, tokens, error):
    """Token ids outside u32 or not integers are refused the same way by both implementations."""
    block_hashes, _ = implementation(impl)
    with pytest.raises(error):
        block_hashes(tokens, 4)


@pytest.mark.parametrize("impl", IMPLS)
def test_block_size_must_be_positive(impl):
    with pytest.raises(ValueError, match="block_size"):
        implementation(impl)[0]([1, 2, 3], 0)
