"""Byte-level detokenization by table: the same text as ``tokenizers``, whole characters only."""

from __future__ import annotations

from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings

from dynamod.daemon.frontend.preprocess import (
    ByteLevelDetokenizer,
    ByteLevelTable,
    IncrementalDetokenizer,
)
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.protocol.model_card import ModelCard
from tests.unit.frontend.preprocess.support import BATCH_SIZES, EOT, FFFD, TEXTS, TOKENIZER, deltas_in_batches

TABLE = ByteLevelTable.build(TOKENIZER.inner)


def detok(**kwargs: Any) -> ByteLevelDetokenizer:
    assert TABLE is not None
    return ByteLevelDetokenizer(TABLE, TOKENIZER.special_token_ids, **kwargs)


def stream(token_ids: list[int], **kwargs: Any) -> list[str]:
    d = detok(**kwargs)
    return [d.add_token(t) for t in token_ids] + [d.flush()]


def test_the_tiny_models_tokenizer_gets_a_table() -> None:
    assert TABLE is not None and len(TABLE) == TOKENIZER.vocab_size


@settings(max_examples=200, deadline=None)
@given(TEXTS, BATCH_SIZES)
def test_any_text_in_any_batches_equals_full_decode(text: str, batch_sizes: list[int]) -> None:
    ids = TOKENIZER.encode(text)
    d = detok()
    deltas = deltas_in_batches(d, ids, batch_sizes)
    if FFFD not in text:
        assert all(FFFD not in x for x in deltas)  # never half a character
    assert "".join(deltas) == TOKENIZER.decode(ids) == text
    assert d.num_tokens == len(ids)


def test_deltas_match_the_window_detokenizer_token_by_token() -> None:
    text = "Hello 世界! 🎉🎉 café — 日本語テキスト 👨‍👩‍👧 end"
    ids = TOKENIZER.encode(text)
    general = IncrementalDetokenizer(TOKENIZER)
    expected = [general.add_token(t) for t in ids] + [general.flush()]
    assert stream(ids) == expected
    assert "" in expected and "🎉" in expected  # held back, then released whole


def test_special_tokens_are_skipped_kept_or_kept_on_request() -> None:
    python_tag = TOKENIZER.token_to_id("<|python_tag|>")
    ids = TOKENIZER.encode("Hi 🎉") + [python_tag, EOT]
    assert "".join(stream(ids)) == "Hi 🎉"
    assert "".join(stream(ids, skip_special_tokens=False)) == "Hi 🎉<|python_tag|><|eot_id|>"
    assert "".join(stream(ids, keep_token_ids=frozenset({python_tag}))) == "Hi 🎉<|python_tag|>"
    d = detok()
    assert d.add_tokens([EOT, EOT]) == "" and d.num_tokens == 2  # counted, not shown


def test_invalid_bytes_become_replacement_characters_as_in_tokenizers() -> None:
    lone_byte = TOKENIZER.token_to_id("\u00ff")  # 0xFF: never valid in UTF-8
    ids = [lone_byte] * 3 + TOKENIZER.encode("中文")
    deltas = stream(ids)
    assert "".join(deltas) == TOKENIZER.decode(ids) == FFFD * 3 + "中文"
    assert sum(x.count(FFFD) for x in deltas) == 3
    # A character cut short at the end of the stream comes out as U+FFFD on flush.
    head = TOKENIZER.encode("🎉")[:-1]
    d = detok()
    assert d.add_tokens(head) == ""
    assert d.flush() == TOKENIZER.decode(head) == FFFD


def test_ids_outside_the_vocabulary_add_nothing_like_tokenizers() -> None:
    ids = [*TOKENIZER.encode("ab"), TOKENIZER.vocab_size + 5, -1, *TOKENIZER.encode("cd")]
    d = detok()
    assert d.add_tokens(ids) + d.flush() == TOKENIZER.decode([i for i in ids if i >= 0]) == "abcd"
    assert d.num_tokens == len(ids)


def _metaspace_tokenizer() -> tokenizers.Tokenizer:
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁": 3, "h": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    return tok


def test_other_decoders_keep_the_general_detokenizer() -> None:
    assert ByteLevelTable.build(_metaspace_tokenizer()) is None


class _DisagreeingInner:
    """The tiny tokenizer, but its decode strips a leading space as some decoders do."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self._inner = inner
        self.decoder = inner.decoder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens).lstrip(" ")


def test_a_table_that_does_not_reproduce_tokenizers_is_refused() -> None:
    assert ByteLevelTable.build(_DisagreeingInner(TOKENIZER.inner)) is None


@pytest.fixture(scope="module")
def pre() -> ModelPreprocessor:
    return ModelPreprocessor.load(ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR)))


def test_the_preprocessor_hands_out_table_detokenizers_keeping_parser_markers(pre: ModelPreprocessor) -> None:
    d = pre.detokenizer(TOKENIZER.encode("prompt"), ("<|python_tag|>",))
    assert isinstance(d, ByteLevelDetokenizer)
    ids = [TOKENIZER.token_to_id("<|python_tag|>"), *TOKENIZER.encode(" call()"), EOT]
    assert d.add_tokens(ids) + d.flush() == "<|python_tag|> call()"
