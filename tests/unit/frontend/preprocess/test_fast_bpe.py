"""The tiktoken-backed prompt encoder gives the ids ``tokenizers`` gives, or is not used at all."""

from __future__ import annotations

import json

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.frontend.preprocess.fast_bpe import FastBpeEncoder
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.daemon.models import TINY_MODEL_DIR

pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_dir(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def fast(tiny: Tokenizer) -> FastBpeEncoder:
    encoder = FastBpeEncoder.build(tiny.inner, "tiny")
    assert encoder is not None, "the tiny model is a byte-level BPE: the fast encoder must take it"
    return encoder


_ALPHABET = st.sampled_from(
    list("abcXYZ019 .,'!?\n\t-_") + ["'s", "'ll", "  ", "\r\n", "é", "中", "🙂", "<|eot_id|>", "<|start_header_id|>"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_ALPHABET, max_size=60))
def test_same_ids_as_tokenizers(tiny: Tokenizer, fast: FastBpeEncoder, parts: list[str]) -> None:
    text = "".join(parts)
    assert fast.encode(text) == tiny.inner.encode(text, add_special_tokens=False).ids


def test_chat_prompt_uses_it_and_matches(tiny: Tokenizer) -> None:
    pre = ModelPreprocessor(tiny, None, str(TINY_MODEL_DIR))
    text = "<|start_header_id|>user<|end_header_id|>\n\nTell me about rivers, 42 of them.<|eot_id|>"
    assert pre._fast is not None
    assert pre._encode_now(text, False) == tiny.inner.encode(text, add_special_tokens=False).ids
    # With special tokens added (completions) the post-processor of ``tokenizers`` still applies.
    assert pre._encode_now(text, True) == tiny.inner.encode(text, add_special_tokens=True).ids


def _variant(tiny: Tokenizer, change) -> tokenizers.Tokenizer:  # noqa: ANN001
    config = json.loads(tiny.inner.to_str())
    change(config)
    return tokenizers.Tokenizer.from_str(json.dumps(config))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda c: c.update(normalizer={"type": "Lowercase"}), id="normalizer"),
        pytest.param(lambda c: c["model"].update(byte_fallback=True), id="byte-fallback"),
        pytest.param(lambda c: c["model"].update(ignore_merges=False), id="merges-not-ignored"),
        pytest.param(lambda c: c["model"]["merges"].reverse(), id="merge-order-not-id-order"),
        pytest.param(lambda c: c["added_tokens"][0].update(lstrip=True), id="stripping-added-token"),
        pytest.param(lambda c: c.update(pre_tokenizer={"type": "Whitespace"}), id="not-byte-level"),
    ],
)
def test_refuses_tokenizers_it_cannot_match(tiny: Tokenizer, change) -> None:  # noqa: ANN001
    assert FastBpeEncoder.build(_variant(tiny, change)) is None


def test_refuses_a_tokenizer_that_disagrees_on_the_sample(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import dynamod.daemon.frontend.preprocess.fast_bpe as fast_bpe

    # A different split regex passes the structural checks but splits differently: the self-check
    # against ``tokenizers`` must catch it.
    monkeypatch.setattr(fast_bpe, "_split_pattern", lambda _pre: r"\S+|\s+")
    assert FastBpeEncoder.build(tiny.inner) is None
