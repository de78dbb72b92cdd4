"""The frontend tokenizer on the shipped tiny model."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.frontend.preprocess.tokenizer import ASYNC_ENCODE_THRESHOLD_CHARS
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.errors import NotFoundError

TOKENIZER = Tokenizer.from_dir(TINY_MODEL_DIR)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_unicode_round_trips(text: str) -> None:
    ids = TOKENIZER.encode(text)
    assert all(0 <= i < TOKENIZER.vocab_size for i in ids)
    assert TOKENIZER.decode(ids, skip_special_tokens=False) == text


def test_multibyte_text_round_trips() -> None:
    text = "Grüße, 世界! 🎉👨‍👩‍👧 naïve café\n\tתודה"
    assert TOKENIZER.decode(TOKENIZER.encode(text)) == text


def test_special_tokens_only_when_asked() -> None:
    bos = TOKENIZER.bos_token_id
    assert bos is not None and TOKENIZER.bos_token == "<|begin_of_text|>"
    assert bos not in TOKENIZER.encode("hello")
    assert TOKENIZER.encode("hello", add_special_tokens=True) == [bos, *TOKENIZER.encode("hello")]


def test_special_token_text_encodes_to_one_id_and_is_skipped_on_decode() -> None:
    eot = TOKENIZER.token_to_id("<|eot_id|>")
    ids = TOKENIZER.encode("hi<|eot_id|>")
    assert ids[-1] == eot and eot in TOKENIZER.special_token_ids
    assert eot in TOKENIZER.eos_token_ids
    assert TOKENIZER.decode(ids) == "hi"
    assert TOKENIZER.decode(ids, skip_special_tokens=False) == "hi<|eot_id|>"


def test_from_dir_without_tokenizer_is_not_found(tmp_path) -> None:
    with pytest.raises(NotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


async def test_encode_async_matches_encode_for_short_and_long_text() -> None:
    short = "a short prompt"
    long = "In the beginning was the word, 世界 🎉. " * (ASYNC_ENCODE_THRESHOLD_CHARS // 10)
    assert len(long) > ASYNC_ENCODE_THRESHOLD_CHARS
    assert await TOKENIZER.encode_async(short) == TOKENIZER.encode(short)
    assert await TOKENIZER.encode_async(long) == TOKENIZER.encode(long)
    assert await TOKENIZER.encode_async(long, add_special_tokens=True) == TOKENIZER.encode(
        long, add_special_tokens=True
    )


async def test_encode_async_of_long_text_leaves_the_event_loop_running() -> None:
    # Long enough to take most of a second to encode; meanwhile the loop must keep serving other
    # tasks. (Plain ``encode`` holds the GIL: on a thread the loop would stall for the whole time.)
    text = "And God said, Let there be light: and there was light. 光 " * 8000
    done = False
    longest_stall = 0.0

    async def other_task() -> None:
        nonlocal longest_stall
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)  # a periodic task, as a server has many of
            now = time.perf_counter()
            longest_stall = max(longest_stall, now - last)
            last = now

    ticker = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    started = time.perf_counter()
    ids = await TOKENIZER.encode_async(text)
    duration = time.perf_counter() - started
    done = True
    await ticker
    assert len(ids) > 10_000
    assert longest_stall < duration / 4, (longest_stall, duration)
