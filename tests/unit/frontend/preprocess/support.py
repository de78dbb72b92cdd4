"""What the detokenizer tests share: the tiny model's tokenizer (loaded once), its end-of-turn id,
the texts and batch sizes they draw, and feeding a detokenizer a token list in those batches."""

from __future__ import annotations

from typing import Protocol

from hypothesis import strategies as st

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR

TOKENIZER = Tokenizer.from_dir(TINY_MODEL_DIR)
EOT = TOKENIZER.token_to_id("<|eot_id|>")
FFFD = "\ufffd"

# Any valid text (no lone surrogates) and the batch sizes a worker's outputs may carry it in.
TEXTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
BATCH_SIZES = st.lists(st.integers(min_value=1, max_value=4), max_size=40)


class Detokenizer(Protocol):
    def add_token(self, token_id: int) -> str: ...
    def add_tokens(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


def deltas_in_batches(detok: Detokenizer, ids: list[int], batch_sizes: list[int]) -> list[str]:
    """The text deltas of ``ids`` fed as batches of ``batch_sizes``, the rest one token at a time,
    then the flush: the shapes a worker's outputs arrive in."""
    deltas: list[str] = []
    pos = 0
    for size in batch_sizes:
        deltas.append(detok.add_tokens(ids[pos : pos + size]))
        pos += size
    deltas += [detok.add_token(t) for t in ids[pos:]]
    deltas.append(detok.flush())
    return deltas
