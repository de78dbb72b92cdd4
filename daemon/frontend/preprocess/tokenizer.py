"""The frontend's tokenizer: a thin wrapper over HF ``tokenizers`` with the model's special ids.

Encoding never adds special tokens unless asked, because the chat template already writes the
BOS token into the prompt text and a second one would shift every position. Long inputs are
encoded on a worker thread through ``encode_batch``, which releases the GIL (plain ``encode``
holds it, so a thread alone would still stall the event loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from dynamod.daemon.models import hf_config
from dynamod.shared.errors import ConfigError, NotFoundError

logger = logging.getLogger(__name__)

# Below this many characters encoding takes well under a millisecond: a thread hop would cost more.
ASYNC_ENCODE_THRESHOLD_CHARS = 4096


class Tokenizer:
    """Encodes text to token ids and back for one model."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token: str | None = None,
    ) -> None:
        # A tokenizer.json may carry truncation/padding from training; serving must never cut a
        # prompt silently (the context-length check reports it instead).
        inner.no_truncation()
        inner.no_padding()
        self._inner = inner
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        added = inner.get_added_tokens_decoder()
        self._special_token_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._bos_token = bos_token
        self._bos_token_id = inner.token_to_id(bos_token) if bos_token is not None else None
        self._vocab_size = inner.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads ``tokenizer.json`` from a model directory, with eos/bos from its config files."""
        model_dir = Path(path)
        tokenizer_file = model_dir / hf_config.TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise NotFoundError(f"no {hf_config.TOKENIZER_FILE} in {model_dir}: pass a model directory")
        try:
            inner = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a plain Exception for any parse error
            raise ConfigError(f"cannot load {tokenizer_file}: {exc}") from exc
        tokenizer_config = hf_config.read_json(model_dir / hf_config.TOKENIZER_CONFIG_FILE)
        eos_ids = hf_config.eos_token_ids(
            model_dir, lambda: {tok.content: i for i, tok in inner.get_added_tokens_decoder().items()}
        )
        tokenizer = cls(
            inner,
            eos_token_ids=eos_ids,
            bos_token=hf_config.token_content(tokenizer_config.get("bos_token")),
        )
        logger.info(
            "tokenizer_loaded path=%s vocab_size=%d eos_token_ids=%s",
            model_dir,
            tokenizer.vocab_size,
            tokenizer.eos_token_ids,
        )
        return tokenizer

    @property
    def inner(self) -> tokenizers.Tokenizer:
        """The wrapped HF tokenizer (the detokenizer decodes windows with it)."""
        return self._inner

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation (copy; callers may extend it with request stop ids)."""
        return list(self._eos_token_ids)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special tokens (skipped in decoded output)."""
        return self._special_token_ids

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    def token_to_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._inner.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; the tokenizer's BOS/post-processing only when asked."""
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Like ``encode``, but long texts are encoded off the event loop."""
        if len(text) <= ASYNC_ENCODE_THRESHOLD_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self._encode_releasing_gil, text, add_special_tokens)

    def _encode_releasing_gil(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        return self._inner.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
