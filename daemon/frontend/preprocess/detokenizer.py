"""Turns a stream of generated token ids into text deltas.

A token is not a character: byte-level BPE splits an emoji or a CJK character over several tokens,
and decoding such a token alone gives U+FFFD. Decoding the whole sequence at every step would fix
that at O(n) per token. Instead (the scheme of HF text-generation-inference and vLLM) we decode a
short window twice: the tokens already emitted as context ("prefix") and the same plus the new
tokens; the text the new tokens add is the difference. While the new text ends in U+FFFD, the
character is incomplete and the delta is held back until a later token completes it. Decoding the
prefix too keeps decoders that strip a leading space (sentencepiece's ``Metaspace``) honest: both
decodes strip the same way.

Special tokens are dropped on input when they are to be skipped, so they never widen the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, and every token carries at least one, so a U+FFFD that is
# still there after this many held-back tokens is a genuinely invalid byte sequence: emit it.
MAX_HELD_TOKENS = 6
# Already-emitted tokens kept as decoding context (for the first generated tokens: the prompt's
# last tokens; vLLM uses the same 5).
CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    """What the generation layer needs from a detokenizer: this module's general one, or
    ``byte_level.ByteLevelDetokenizer`` (a table lookup per token) for byte-level tokenizers."""

    @property
    def num_tokens(self) -> int: ...

    def add_token(self, token_id: int) -> str: ...

    def add_tokens(self, token_ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Per-request decoder state; ``add_tokens`` returns only whole characters."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
        keep_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """``prompt_token_ids``: the prompt's last tokens are decoding context, never output.

        With them the first generated token keeps a leading space that a sentencepiece decoder
        would strip at the start of a text ("Hello" + " world", not "Hello" + "world").

        ``keep_token_ids``: special tokens that stay in the text although special tokens are
        skipped: the markers an output parser reads (``[TOOL_CALLS]``, ``<|python_tag|>``).
        """
        self._inner = tokenizer.inner
        skip_ids = tokenizer.special_token_ids - keep_token_ids if skip_special_tokens else frozenset()
        self._skip_ids = skip_ids
        # The window never holds a skipped id, so with kept ones the decoder must not drop specials.
        self._skip_special_tokens = skip_special_tokens and not keep_token_ids
        context = [t for t in (prompt_token_ids or ()) if t not in self._skip_ids]
        # _window holds the prefix tokens followed by the not-yet-emitted tokens.
        self._window: list[int] = context[-CONTEXT_TOKENS:]
        self._prefix_len = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Generated tokens seen so far (special ones included)."""
        return self._num_tokens

    def add_token(self, token_id: int) -> str:
        """Consumes one token; returns the text it completes (possibly empty)."""
        return self.add_tokens((token_id,))

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Consumes tokens; returns the new text, never ending in an incomplete character."""
        added = False
        for token_id in token_ids:
            self._num_tokens += 1
            if token_id not in self._skip_ids:
                self._window.append(token_id)
                added = True
        if not added:
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        """Returns whatever is held back (an incomplete character decodes as U+FFFD); call at end."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        held = len(self._window) - self._prefix_len
        if held == 0:
            return ""
        full_text = self._decode(self._window)
        complete = (
            len(full_text) > len(self._prefix_text)
            and full_text.startswith(self._prefix_text)
            and not full_text.endswith(REPLACEMENT_CHAR)
        )
        if complete or final:
            return self._emit(len(self._window), full_text)
        if held < MAX_HELD_TOKENS:
            return ""
        # Held too long: the text has invalid bytes. Emit them (as U+FFFD), but keep holding the
        # last 1-3 tokens if they are the start of a character a later token may still complete.
        for keep in (1, 2, 3):
            if keep >= held:
                break
            head = self._decode(self._window[:-keep])
            if full_text.endswith(REPLACEMENT_CHAR) and head == full_text[:-1]:
                return self._emit(len(self._window) - keep, head)
        return self._emit(len(self._window), full_text)

    def _emit(self, upto: int, text: str) -> str:
        """Emits ``text`` (the decode of ``window[:upto]``) past the prefix; those tokens become the prefix."""
        # If the new tokens changed how the prefix decodes (only around invalid bytes), what was
        # already emitted cannot be taken back: emit what lies past its length.
        delta = text[len(self._prefix_text) :]
        # A few emitted tokens are enough context; older ones would only make each decode longer.
        start = max(0, upto - CONTEXT_TOKENS)
        self._window = self._window[start:]
        self._prefix_len = upto - start
        self._prefix_text = self._decode(self._window[: self._prefix_len])
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._inner.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
