"""Detokenization for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, ... style) without decoding.

With a ``ByteLevel`` decoder every token id stands for a fixed byte string: its vocabulary entry
written in GPT-2's bytes-to-unicode alphabet (an added token whose text is not in that alphabet
stands for its own UTF-8 bytes), and the decoded text is the concatenation of those bytes read as
UTF-8 with invalid sequences replaced by U+FFFD. So the text a new token adds is found by
appending its bytes to a UTF-8 incremental decoder, which holds back an incomplete character by
itself: a table lookup per token, where ``IncrementalDetokenizer`` decodes a window of tokens
twice per step (~3 us per token on the frontend's hot path, a tenth of a request's CPU).

``ByteLevelTable.build`` accepts a tokenizer only when its decoder is exactly ``ByteLevel`` and the
table reproduces ``tokenizers``' own decode on a sample (every added token, every single-byte token,
a spread of the vocabulary, and mixed sequences); anything else (SentencePiece's ``Metaspace``,
byte fallback, a decoder sequence) returns None and the caller keeps ``IncrementalDetokenizer``.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

# Vocabulary ids checked one by one against ``tokenizers`` beyond the added and single-byte ones.
_SELF_CHECK_SPREAD = 512
_SELF_CHECK_TEXTS = (
    "Hello, world! How's it going? numbers 1 12 123 3.14 -42",
    "Unicode: naïve café, Ελληνικά, русский, 中文字符, 日本語, emoji 🙂👍🏽, ZWJ 👨‍👩‍👧",
    "code: def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\t end  ",
)

_utf8_decoder = codecs.getincrementaldecoder("utf-8")


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table that byte-level vocabularies are written in."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _token_bytes(token: str, byte_decoder: dict[str, int]) -> bytes:
    """What ``tokenizers``' ByteLevel decoder makes of one token string: its characters mapped back
    to bytes, or, when one of them is outside the alphabet (an added token like ``"<br> "``), the
    string's own UTF-8 bytes."""
    try:
        return bytes(byte_decoder[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


class ByteLevelTable:
    """Token id -> the bytes it decodes to, for one byte-level tokenizer."""

    __slots__ = ("_bytes",)

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes

    def __len__(self) -> int:
        return len(self._bytes)

    def bytes_of(self, token_ids: Iterable[int]) -> bytes:
        """The bytes of ``token_ids``; ids outside the vocabulary add nothing (as in ``tokenizers``)."""
        table = self._bytes
        size = len(table)
        return b"".join([table[t] for t in token_ids if 0 <= t < size])

    def decode(self, token_ids: Iterable[int]) -> str:
        return self.bytes_of(token_ids).decode("utf-8", "replace")

    @classmethod
    def build(cls, inner: Any) -> ByteLevelTable | None:
        """The table of the ``tokenizers.Tokenizer`` ``inner``, or None when its decode is not a
        plain byte-level one (see the module docstring). Blocking: ~0.1 s for a 128k vocabulary."""
        decoder = getattr(inner, "decoder", None)
        if decoder is None or type(decoder).__name__ != "ByteLevel":
            return None
        try:
            size = inner.get_vocab_size(with_added_tokens=True)
            byte_decoder = gpt2_byte_decoder()
            token_bytes = []
            for token_id in range(size):
                token = inner.id_to_token(token_id)
                token_bytes.append(b"" if token is None else _token_bytes(token, byte_decoder))
        except (AttributeError, TypeError):
            return None
        table = cls(token_bytes)
        try:
            agrees = table._agrees_with(inner)
        except (AttributeError, TypeError, ValueError) as exc:  # an inner without the full API
            logger.info("byte-level detokenizer not checked; not used reason=%s", exc)
            return None
        if not agrees:
            logger.warning("byte-level detokenizer disagrees with tokenizers on a sample; not used")
            return None
        return table

    def _agrees_with(self, inner: Any) -> bool:
        size = len(self._bytes)
        added = sorted(inner.get_added_tokens_decoder())
        single_bytes = [inner.token_to_id(ch) for ch in gpt2_byte_decoder()]
        spread = range(0, size, max(1, size // _SELF_CHECK_SPREAD))
        ids = [i for i in (*added, *single_bytes, *spread) if i is not None]
        for token_id in ids:
            if self.decode((token_id,)) != inner.decode([token_id], skip_special_tokens=False):
                return False
        sequences = [inner.encode(text, add_special_tokens=False).ids for text in _SELF_CHECK_TEXTS]
        sequences.append([*added, *sequences[0], *added, size + 7])  # an id past the vocabulary too
        return all(self.decode(seq) == inner.decode(seq, skip_special_tokens=False) for seq in sequences)


class ByteLevelDetokenizer:
    """``IncrementalDetokenizer``'s interface for byte-level tokenizers: whole characters only,
    the same text as a full decode, a table lookup per token.

    No prompt context is needed: a byte-level decoder strips nothing at the start of a text, so a
    token's bytes mean the same wherever the text begins."""

    __slots__ = ("_table", "_size", "_skip_ids", "_utf8", "_num_tokens")

    def __init__(
        self,
        table: ByteLevelTable,
        special_token_ids: frozenset[int],
        *,
        skip_special_tokens: bool = True,
        keep_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """``keep_token_ids``: special tokens that stay in the text although special tokens are
        skipped (the markers an output parser reads)."""
        self._table = table._bytes
        self._size = len(self._table)
        if not skip_special_tokens:
            self._skip_ids: frozenset[int] = frozenset()
        else:  # without kept markers the tokenizer's own set serves as is: no copy per request
            self._skip_ids = special_token_ids - keep_token_ids if keep_token_ids else special_token_ids
        self._utf8 = _utf8_decoder("replace")
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Generated tokens seen so far (special ones included)."""
        return self._num_tokens

    def add_token(self, token_id: int) -> str:
        """Consumes one token; returns the text it completes (possibly empty)."""
        self._num_tokens += 1
        if token_id in self._skip_ids or not 0 <= token_id < self._size:
            return ""
        return self._utf8.decode(self._table[token_id])

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Consumes tokens; returns the new text, never ending in an incomplete character."""
        table = self._table
        size = self._size
        skip = self._skip_ids
        pieces = []
        count = 0
        for token_id in token_ids:
            count += 1
            if token_id not in skip and 0 <= token_id < size:
                pieces.append(table[token_id])
        self._num_tokens += count
        if not pieces:
            return ""
        return self._utf8.decode(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def flush(self) -> str:
        """Returns whatever is held back (an incomplete character decodes as U+FFFD); call at end."""
        return self._utf8.decode(b"", True)
