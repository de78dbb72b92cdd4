"""Structured outputs in the mocker: random output that the grammar engine (llguidance) accepts.

``GuidedVocab`` is the model's vocabulary as llguidance sees it (built once per engine from the
model's ``tokenizer.json``, off the event loop); ``GuidedState`` is one request's matcher. Each
step the state asks the matcher for the token mask, and the request's sampler draws only allowed
tokens, so every token is valid by construction: no JSON (or regex) is written by hand here.

Random tokens alone would rarely finish: inside a JSON string the closing quote is one token in
thousands. So each request has a soft length (a random "verbosity"). Before it, tokens are drawn
freely from the mask; from it on (or when the budget runs low), the state steers towards the end:
it prefers stopping as soon as the grammar accepts, and otherwise picks, among the allowed
single-byte tokens (which can spell anything), the one after which the grammar allows the fewest
continuations, a cheap one-step look-ahead that closes strings, arrays and objects in a few steps.
Ending is decided right after a token: when the grammar is complete, or accepts and the request
wants to stop, the request finishes with "stop" after that token.
"""

from __future__ import annotations

import logging
import string
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.guided_grammar import compile_guided, new_matcher
from dynamod.shared.protocol.llm import GuidedDecoding

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

SOFT_LENGTH_MIN = 4
SOFT_LENGTH_MAX = 32
EARLY_STOP_P = 0.15  # before the soft length: chance to stop at a point where the grammar accepts
STEER_MARGIN = 24  # start steering when this few tokens of budget are left
_MAX_STEER_CANDIDATES = 8  # non-punctuation candidates looked at per steering step
_PUNCTUATION = frozenset(string.punctuation)
_TEMPLATE_CACHE = 64  # compiled matchers kept per engine


class GuidedVocab:
    """The model's vocabulary for llguidance, plus which tokens are single bytes. Built lazily:
    a worker that never sees a constrained request never loads it."""

    def __init__(self, tokenizer_path: Path | str | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._path = Path(tokenizer_path) if tokenizer_path is not None else None
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: dict[str, llguidance.LLMatcher] = {}  # grammar -> unused matcher (LRU)
        self.single_byte: np.ndarray = np.empty(0, dtype=np.int64)
        self.punctuation: np.ndarray = np.empty(0, dtype=np.int64)  # single-byte ASCII punctuation
        self.other_bytes: np.ndarray = np.empty(0, dtype=np.int64)  # the other single-byte tokens

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (loads it on first use; blocking: call from a thread)."""
        tok = self._tokenizer
        if tok is None:
            with self._lock:
                tok = self._tokenizer
                if tok is None:
                    tok = self._load()
        return tok

    def _load(self) -> llguidance.LLTokenizer:
        if self._path is None or not self._path.is_file():
            raise InvalidRequestError(
                "this mocker worker has no tokenizer.json, so it cannot constrain its output; "
                "start it with a model directory (or --model tiny)"
            )
        import llguidance

        text = self._path.read_text(encoding="utf-8")
        eos = self._eos or None
        tok = llguidance.LLTokenizer(text, n_vocab=max(self.vocab_size, _tokenizer_size(text)), eos_token=eos)
        n = min(self.vocab_size, tok.vocab_size)
        single = [t for t in range(n) if not tok.is_special_token(t) and len(tok.decode_bytes([t])) == 1]
        self.single_byte = np.array(single, dtype=np.int64)
        punct = {t for t in single if chr(tok.decode_bytes([t])[0]) in _PUNCTUATION}
        self.punctuation = np.array(sorted(punct), dtype=np.int64)
        self.other_bytes = np.array([t for t in single if t not in punct], dtype=np.int64)
        self._tokenizer = tok
        return tok

    def new_state(self, guided: GuidedDecoding, seed: int) -> GuidedState:
        """A request's matcher (blocking on the first call: loads the vocabulary; and for a new
        constraint: compiles it). A constraint seen before costs a copy of its fresh matcher."""
        grammar = compile_guided(guided)
        with self._lock:
            template = self._templates.pop(grammar, None)
        if template is None:
            template = new_matcher(self.tokenizer, grammar)
        with self._lock:
            self._templates[grammar] = template  # most recently used last
            while len(self._templates) > _TEMPLATE_CACHE:
                del self._templates[next(iter(self._templates))]
        return GuidedState(self, template.deep_copy(), seed)


def _tokenizer_size(text: str) -> int:
    """Token ids a tokenizer.json uses (learned + added), without a second parse by tokenizers."""
    import json

    data = json.loads(text)
    ids = list((data.get("model") or {}).get("vocab", {}).values())
    ids += [t.get("id", 0) for t in data.get("added_tokens") or []]
    return (max(ids) + 1) if ids else 0


class GuidedState:
    """One request's grammar state: the next token mask and the steering policy."""

    __slots__ = ("_vocab", "matcher", "_rng", "soft_length", "complete", "_steered")

    def __init__(self, vocab: GuidedVocab, matcher: llguidance.LLMatcher, seed: int) -> None:
        self._vocab = vocab
        self.matcher = matcher
        self._rng = np.random.default_rng(seed)
        self.soft_length = int(self._rng.integers(SOFT_LENGTH_MIN, SOFT_LENGTH_MAX))
        self.complete = False  # the request should end with "stop" after the last token
        self._steered: dict[int, int] = {}  # token -> times steering chose it

    def allowed(self) -> np.ndarray:
        """Boolean mask over the engine's vocabulary of the tokens the grammar allows next (EOS
        excluded: ending is decided after each token, see ``advance``)."""
        vocab = self._vocab
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(vocab.vocab_size, dtype=bool)
        n = min(vocab.vocab_size, bits.size)
        mask[:n] = bits[:n].astype(bool)
        eos = [t for t in vocab.tokenizer.eos_tokens if 0 <= t < mask.size]
        mask[eos] = False
        if not mask.any():
            # Nothing but EOS (or nothing at all: a matcher in error) can follow. ``advance``
            # completes a stopped grammar before it gets here, so this is a defensive end: emit
            # EOS (any token if the model has none) and finish, rather than fail the whole step.
            self.complete = True
            if eos:
                mask[eos] = True
            else:
                mask[:] = True
        return mask

    def steering(self, num_output: int, max_output: int) -> bool:
        """Whether this step should steer towards the end instead of sampling freely: past the
        soft length, or with little budget left (up to half of it, for short budgets)."""
        left = max_output - num_output
        return num_output >= self.soft_length or left <= min(STEER_MARGIN, max_output // 2)

    def steer(self, mask: np.ndarray) -> int:
        """The allowed token that most nearly ends the output: one after which the grammar
        accepts, else the one after which it allows the fewest continuations, weighted by how
        often steering already chose that token (a "," that always forces one more array item
        would otherwise be chosen forever over the "]" that ends the array). Candidates are the
        allowed single-byte punctuation tokens (the grammar's structure) and a sample of the
        other allowed single-byte tokens (or, if no single byte fits, of all allowed ones)."""
        cands = self._candidates(mask)
        if cands.size == 1:
            return self._chosen(int(cands[0]))
        matcher = self.matcher
        steered = self._steered
        best, best_score = int(cands[0]), -1
        start = int(self._rng.integers(cands.size))  # ties go to a random candidate
        for i in range(cands.size):
            token = int(cands[(start + i) % cands.size])
            if not matcher.consume_token(token):
                continue
            if matcher.is_accepting():
                matcher.rollback(1)
                return self._chosen(token)
            count = int.from_bytes(matcher.compute_bitmask(), "little").bit_count()
            matcher.rollback(1)
            score = count * (1 + steered.get(token, 0)) ** 2
            if best_score < 0 or score < best_score:
                best, best_score = token, score
        return self._chosen(best)

    def _chosen(self, token: int) -> int:
        self._steered[token] = self._steered.get(token, 0) + 1
        return token

    def _candidates(self, mask: np.ndarray) -> np.ndarray:
        vocab = self._vocab
        punct = vocab.punctuation[mask[vocab.punctuation]]
        other = vocab.other_bytes[mask[vocab.other_bytes]]
        if not punct.size and not other.size:
            other = np.flatnonzero(mask)  # no single-byte token fits: multi-byte ones
        if other.size > _MAX_STEER_CANDIDATES:
            other = self._rng.choice(other, _MAX_STEER_CANDIDATES, replace=False)
        return np.concatenate((punct, other)) if punct.size else other

    def advance(self, token: int, *, may_stop: bool, steering: bool) -> None:
        """Feeds the sampled token to the grammar; sets ``complete`` when the output should end
        here: the grammar allows nothing more, or it accepts and the request may stop
        (``may_stop``: min_tokens reached and EOS not ignored) and wants to (``steering``, or by
        chance before that, as a model emits EOS)."""
        matcher = self.matcher
        if self.complete:
            return  # the defensive end in ``allowed``: nothing to feed
        if not matcher.consume_token(token):
            # Tokens come from the matcher's own mask, so this is a matcher bug: end the output
            # here (its text so far is what the grammar accepted) instead of failing the step.
            logger.warning("mocker grammar refused its own token token=%d error=%s", token, matcher.get_error())
            self.complete = True
            return
        if matcher.is_stopped():
            self.complete = True
        elif may_stop and matcher.is_accepting() and (steering or self._rng.random() < EARLY_STOP_P):
            self.complete = True
