"""Incremental detokenization: whole characters only, equal to a full decode, bounded work."""

from __future__ import annotations

from hypothesis import assume, given, settings

from dynamod.daemon.frontend.preprocess import IncrementalDetokenizer, Tokenizer
from tests.unit.frontend.preprocess.support import BATCH_SIZES, EOT, FFFD, TEXTS, TOKENIZER, deltas_in_batches


def stream(token_ids: list[int], **kwargs: object) -> list[str]:
    detok = IncrementalDetokenizer(TOKENIZER, **kwargs)  # type: ignore[arg-type]
    return [detok.add_token(t) for t in token_ids] + [detok.flush()]


def test_emoji_and_cjk_token_by_token_never_emit_broken_characters() -> None:
    text = "Hello 世界! 🎉🎉 café — 日本語テキスト 👨‍👩‍👧 end"
    ids = TOKENIZER.encode(text)
    assert len(ids) > len(text) // 2  # multi-byte characters really are split over tokens here
    deltas = stream(ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas  # some tokens held back a partial character
    assert "🎉" in deltas  # ...and the completing token released it whole


@settings(max_examples=200, deadline=None)
@given(TEXTS, BATCH_SIZES)
def test_any_text_in_any_batches_equals_full_decode(text: str, batch_sizes: list[int]) -> None:
    ids = TOKENIZER.encode(text)
    # Text that spells a special token ("<|python_tag|>") encodes to it, and decoding skips special
    # tokens: that round trip is not the text by design (test_special_tokens_... covers it).
    assume(not TOKENIZER.special_token_ids.intersection(ids))
    deltas = deltas_in_batches(IncrementalDetokenizer(TOKENIZER), ids, batch_sizes)
    # Valid text never yields U+FFFD unless it contained one.
    if FFFD not in text:
        assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == TOKENIZER.decode(ids) == text


def test_special_tokens_are_skipped_or_kept_on_request() -> None:
    ids = TOKENIZER.encode("Hi 🎉") + [EOT]
    assert "".join(stream(ids)) == "Hi 🎉"
    assert "".join(stream(ids, skip_special_tokens=False)) == "Hi 🎉<|eot_id|>"


def test_prompt_context_is_never_emitted() -> None:
    prompt = TOKENIZER.encode("The prompt says 世")
    completion = TOKENIZER.encode(" and then 界 more")
    deltas = stream(completion, prompt_token_ids=prompt)
    assert "".join(deltas) == " and then 界 more"


def test_invalid_bytes_are_released_and_a_following_character_stays_whole() -> None:
    lone_byte = TOKENIZER.token_to_id("\u00ff")  # byte 0xFF: never valid in UTF-8
    assert lone_byte is not None
    ids = [lone_byte] * 7 + TOKENIZER.encode("中文")
    deltas = stream(ids)
    assert "".join(deltas) == TOKENIZER.decode(ids) == FFFD * 7 + "中文"
    assert any(d and set(d) == {FFFD} for d in deltas[:7])  # not held until the end
    # The bytes of 中 came after seven invalid ones; none of them was emitted as a broken piece.
    assert sum(d.count(FFFD) for d in deltas) == 7


class _CountingInner:
    """Wraps the HF tokenizer to record how many ids each decode call gets."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.decode_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_sizes.append(len(ids))
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)  # type: ignore[attr-defined]


class _CountingTokenizer(Tokenizer):
    def __init__(self, base: Tokenizer) -> None:
        self.__dict__.update(base.__dict__)
        self.counting = _CountingInner(base.inner)

    @property
    def inner(self):  # type: ignore[override]
        return self.counting


def test_work_per_token_stays_bounded_on_long_outputs() -> None:
    counting = _CountingTokenizer(TOKENIZER)
    text = "In the beginning 世界 was the 🎉 word. " * 150
    ids = counting.encode(text)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.add_token(t) for t in ids) + detok.flush()
    assert out == text
    assert max(counting.counting.decode_sizes) <= 12
    assert len(counting.counting.decode_sizes) <= 3 * len(ids)
