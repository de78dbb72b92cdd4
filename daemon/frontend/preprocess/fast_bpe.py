"""A faster encoder for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, ... style), on tiktoken.

Encoding the prompt is the largest single cost of a plain chat request in the frontend: for a
~200-token prompt the ``tokenizers`` library spends ~140 us, nearly all of it in its regex
pre-tokenizer, where tiktoken's encoder does the same work in ~30 us. The two compute the same
ids when the tokenizer is a plain byte-level BPE: no normalizer, one split regex, merges whose
ranks follow the token ids, and added tokens that are matched literally. ``FastBpeEncoder.build``
accepts a tokenizer only when its ``tokenizer.json`` says exactly that, and then checks itself
against ``tokenizers`` on sample texts; anything else (SentencePiece models, byte fallback, a
normalizer, stripped added tokens, tiktoken not installed) returns None and the caller keeps the
``tokenizers`` path. Decoding has its own table-driven path for the same tokenizers
(``byte_level.py``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .byte_level import gpt2_byte_decoder

logger = logging.getLogger(__name__)

# The pre-tokenizer regex that ``ByteLevel(use_regex=True)`` applies (GPT-2's).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Texts the encoder must agree on with ``tokenizers`` before it is used (the added tokens are
# checked as well, placed inside text).
_SELF_CHECK_TEXTS = (
    "Hello, world! How's it going? I'm fine; we'll see, they've said, you'd think.",
    "  leading spaces, trailing spaces   \n\n\tand tabs\r\n  ",
    "numbers 1 12 123 1234 12345 3.14159 -42 0x1F 1e-9, dates 2024-01-31",
    "Unicode: naïve café, Ελληνικά, русский, 中文字符, 日本語, 한국어, emoji 🙂👍🏽, ZWJ 👨‍👩‍👧",
    "code: def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n    if x >= 10 and y != 0: pass",
    "MixedCASE CamelCase snake_case kebab-case SHOUTING 'QUOTED' \"double\" `back`",
    "",
)


def _split_pattern(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The one regex of a byte-level pre-tokenizer, or None if it is anything else."""
    if pre_tokenizer is None:
        return None
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None
        return _GPT2_PATTERN
    if kind != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or "Regex" not in (split.get("pattern") or {})
    ):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space") or byte_level.get("use_regex", True):
        return None
    return str(split["pattern"]["Regex"])


def _mergeable_ranks(model: dict[str, Any]) -> dict[bytes, int] | None:
    """Byte strings to ids, if merging by id is merging by the BPE merge order; else None.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank and emits a whole
    piece found in the vocabulary as is; ``tokenizers`` merges the pair listed first in ``merges``
    (and, with ``ignore_merges``, also emits whole pieces). They agree when every token but the
    256 single bytes is the result of exactly one merge and results get larger ids down the list.
    """
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or not model.get("ignore_merges"):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    merges = model.get("merges") or []
    decoder = gpt2_byte_decoder()
    ranks: dict[bytes, int] = {}
    try:
        for token, token_id in vocab.items():
            ranks[bytes(decoder[ch] for ch in token)] = token_id
    except KeyError:
        return None  # not a byte-level vocabulary
    if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    if len(merges) != len(vocab) - 256:
        return None
    previous = -1
    results: set[str] = set()
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        result = left + right
        result_id = vocab.get(result)
        if result_id is None or result_id <= previous or result in results:
            return None
        if vocab.get(left, result_id) >= result_id or vocab.get(right, result_id) >= result_id:
            return None
        results.add(result)
        previous = result_id
    return ranks


class FastBpeEncoder:
    """``encode(text)`` with the ids ``tokenizers`` gives for ``add_special_tokens=False``."""

    __slots__ = ("_encode", "name")

    def __init__(self, encoding: Any, name: str) -> None:
        self.name = name
        self._encode = encoding.encode

    def encode(self, text: str) -> list[int]:
        return self._encode(text, allowed_special="all")

    @classmethod
    def build(cls, inner: Any, name: str = "tokenizer") -> FastBpeEncoder | None:
        """The fast encoder for the ``tokenizers.Tokenizer`` ``inner``, or None when it cannot
        give the same ids (see the module docstring). Blocking: ~0.1 s for a 128k vocabulary."""
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            config = json.loads(inner.to_str())
        except (ValueError, AttributeError, TypeError):
            return None
        if config.get("normalizer") is not None:
            return None
        pattern = _split_pattern(config.get("pre_tokenizer"))
        if pattern is None:
            return None
        ranks = _mergeable_ranks(config.get("model") or {})
        if ranks is None:
            return None
        added: dict[str, int] = {}
        for token in config.get("added_tokens") or []:
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                return None
            added[token["content"]] = int(token["id"])
        try:
            encoding = tiktoken.Encoding(
                name=f"dynamod-{name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added
            )
        except (ValueError, TypeError) as exc:  # a regex its engine does not take, clashing ids
            logger.info("fast tokenizer unavailable name=%s reason=%s", name, exc)
            return None
        fast = cls(encoding, name)
        if not fast._agrees_with(inner, added):
            logger.warning("fast tokenizer disagrees with tokenizers on a sample; not used name=%s", name)
            return None
        return fast

    def _agrees_with(self, inner: Any, added: dict[str, int]) -> bool:
        texts = list(_SELF_CHECK_TEXTS)
        specials = list(added)[:64]
        if specials:
            texts.append("x " + " a".join(specials) + "b\n" + "".join(specials))
        for text in texts:
            if self.encode(text) != inner.encode(text, add_special_tokens=False).ids:
                return False
        return True
