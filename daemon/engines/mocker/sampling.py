"""``TokenSampler``: the mocker's stand-in for a model's logits, for requests that need them.

The mocker's default sampler is a per-request LCG: one multiply per token, output uniform over the
vocabulary. That is all a load test needs, and it stays the path for every request that asks for
nothing more. A request that does ask for more (log-probabilities, an output constraint, a logit
bias, allowed token ids, or repetition/presence/frequency penalties) gets a ``TokenSampler``
instead, which runs vLLM's sampling pipeline over random logits:

    random logits (a few tokens boosted, as a model is confident in a few)
    -> allowed_token_ids, min_tokens stop masking, the grammar's mask
    -> logit_bias -> repetition, frequency and presence penalties
    -> temperature, top_k, top_p, min_p -> sample (greedy at temperature 0)

so each option has its real effect (a banned token never appears, a penalised one rarely repeats),
and the reported log-probabilities are the log-softmax of the distribution the token was drawn
from: the sampled token is at or near the top, and ``top_logprobs`` lists real token ids. When the
grammar state steers towards the end (``guided.py``), its chosen token is made the distribution's
top, as if the model wanted to close. Costs O(vocabulary) numpy work per token, only for these
requests.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from dynamod.daemon.engines.mocker.guided import GuidedState
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import SamplingOptions

_BOOSTED = 3  # tokens per step the "model" is confident in


class SampledRequest(Protocol):
    """What the sampler reads of the request it samples for (``request.MockRequest`` is one). A
    protocol here, so that the request, which holds a sampler, is the only one of the two that
    imports the other."""

    @property
    def num_output_tokens(self) -> int: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def stop_ids(self) -> frozenset[int]: ...


def needs_sampler(options: SamplingOptions) -> bool:
    """Whether a request needs ``TokenSampler`` rather than the LCG (which cannot honour these)."""
    return (
        options.logprobs is not None
        or options.guided_decoding is not None
        or bool(options.logit_bias)
        or options.allowed_token_ids is not None
        or bool(options.presence_penalty)
        or bool(options.frequency_penalty)
        or (options.repetition_penalty is not None and options.repetition_penalty != 1.0)
    )


class TokenSampler:
    """Samples one request's tokens from random logits under its sampling options."""

    __slots__ = (
        "vocab_size", "_rng", "_temperature", "_top_k", "_top_p", "_min_p", "_presence", "_frequency",
        "_repetition", "_bias_ids", "_bias_values", "_allowed", "_counts", "_seen", "num_top", "guided",
        "_ignore_eos", "_uniform", "last_logprob", "last_top",
    )

    def __init__(
        self,
        options: SamplingOptions,
        *,
        vocab_size: int,
        seed: int,
        prompt_token_ids: list[int],
        ignore_eos: bool = False,
        guided: GuidedState | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._ignore_eos = ignore_eos
        self._rng = np.random.default_rng(seed)
        self._temperature = 1.0 if options.temperature is None else float(options.temperature)
        if self._temperature < _GREEDY_BELOW:
            self._temperature = 0.0  # as vLLM: a temperature this small is greedy (and 1/T overflows)
        self._top_k = options.top_k if options.top_k is not None and options.top_k > 0 else 0
        self._top_p = 1.0 if options.top_p is None else float(options.top_p)
        self._min_p = 0.0 if options.min_p is None else float(options.min_p)
        self._presence = float(options.presence_penalty or 0.0)
        self._frequency = float(options.frequency_penalty or 0.0)
        self._repetition = 1.0 if options.repetition_penalty is None else float(options.repetition_penalty)
        self._bias_ids: np.ndarray | None = None
        self._bias_values: np.ndarray | None = None
        if options.logit_bias:
            ids = np.fromiter(options.logit_bias.keys(), dtype=np.int64)
            _check_ids(ids, vocab_size, "logit_bias")
            self._bias_ids = ids
            self._bias_values = np.fromiter(options.logit_bias.values(), dtype=np.float32)
        self._allowed: np.ndarray | None = None
        if options.allowed_token_ids is not None:
            ids = np.asarray(options.allowed_token_ids, dtype=np.int64)
            if ids.size == 0:
                raise InvalidRequestError("allowed_token_ids is empty", param="allowed_token_ids")
            _check_ids(ids, vocab_size, "allowed_token_ids")
            self._allowed = np.zeros(vocab_size, dtype=bool)
            self._allowed[ids] = True
        # Output token counts (frequency/presence) and prompt-or-output presence (repetition).
        self._counts = np.zeros(vocab_size, dtype=np.float32) if (self._presence or self._frequency) else None
        self._seen: np.ndarray | None = None
        if self._repetition != 1.0:
            self._seen = np.zeros(vocab_size, dtype=bool)
            self._seen[np.asarray(prompt_token_ids, dtype=np.int64)] = True
        self.num_top = options.logprobs  # None: no log-probabilities wanted
        self.guided = guided
        # Only a grammar to follow: draw uniformly among the allowed tokens, as the LCG does over
        # the whole vocabulary, without building logits (the temperature and truncations of
        # uniform noise change nothing worth the cost).
        self._uniform = (
            guided is not None and self.num_top is None and self._bias_ids is None and self._allowed is None
            and self._counts is None and self._seen is None
        )
        self.last_logprob = 0.0
        self.last_top: list[tuple[int, float]] | None = None

    @property
    def complete(self) -> bool:
        """The output constraint is satisfied and the request should end with "stop"."""
        return self.guided is not None and self.guided.complete

    def sample(self, request: SampledRequest) -> int:
        """The next token of ``request``; sets ``last_logprob``/``last_top`` when asked for."""
        num_output = request.num_output_tokens
        mask = self._mask(request, num_output)
        if self._uniform:
            return self._sample_uniform(request, mask, num_output)
        logits = self._rng.standard_normal(self.vocab_size, dtype=np.float32)
        candidates = np.flatnonzero(mask) if mask is not None else None
        n = self.vocab_size if candidates is None else candidates.size
        picks = self._rng.integers(n, size=min(_BOOSTED, n))
        logits[picks if candidates is None else candidates[picks]] += np.float32(np.log(n) + 1.0)
        self._apply_bias_and_penalties(logits)
        if mask is not None:
            logits[~mask] = -np.inf
        guided = self.guided
        steering = guided is not None and guided.steering(num_output, request.max_output_tokens)
        if steering:
            assert guided is not None and mask is not None
            token = guided.steer(mask)
            top = np.max(logits[np.isfinite(logits)]) if np.isfinite(logits).any() else 0.0
            logits[token] = top + 1.0  # the model "wants" to close: its choice is the top
            processed = logits
        else:
            processed = self._truncate(logits)
            token = self._draw(processed)
        if self.num_top is not None:
            self._record_logprobs(processed, token)
        if self._counts is not None:
            self._counts[token] += 1.0
        if self._seen is not None:
            self._seen[token] = True
        if guided is not None:
            may_stop = num_output + 1 >= request.min_tokens and not self._ignore_eos
            guided.advance(token, may_stop=may_stop, steering=steering)
        return token

    def _sample_uniform(self, request: SampledRequest, mask: np.ndarray | None, num_output: int) -> int:
        guided = self.guided
        assert guided is not None and mask is not None
        steering = guided.steering(num_output, request.max_output_tokens)
        if steering:
            token = guided.steer(mask)
        else:
            allowed = np.flatnonzero(mask)
            token = int(allowed[self._rng.integers(allowed.size)])
        guided.advance(token, may_stop=num_output + 1 >= request.min_tokens and not self._ignore_eos, steering=steering)
        return token

    # ---- the pipeline ----------------------------------------------------------------------------

    def _mask(self, request: SampledRequest, num_output: int) -> np.ndarray | None:
        """Allowed tokens this step (None: all): allowed_token_ids, stop tokens below min_tokens,
        and the grammar's mask. An intersection left empty keeps the grammar's (it must hold)."""
        mask = None if self._allowed is None else self._allowed.copy()
        if request.stop_ids and num_output < request.min_tokens:
            stops = np.fromiter((t for t in request.stop_ids if 0 <= t < self.vocab_size), dtype=np.int64)
            if mask is None:
                mask = np.ones(self.vocab_size, dtype=bool)
            mask[stops] = False
        if self.guided is not None:
            grammar = self.guided.allowed()
            if mask is None:
                return grammar
            both = mask & grammar
            return both if both.any() else grammar
        if mask is not None and not mask.any():
            return self._allowed  # allowed_token_ids are all stop tokens: min_tokens yields to them
        return mask

    def _apply_bias_and_penalties(self, logits: np.ndarray) -> None:
        if self._bias_ids is not None:
            logits[self._bias_ids] += self._bias_values
        if self._seen is not None:
            r = np.float32(self._repetition)
            seen = self._seen
            with np.errstate(over="ignore", divide="ignore"):  # extremes are clipped below
                logits[seen] = np.where(logits[seen] > 0, logits[seen] / r, logits[seen] * r)
        if self._counts is not None:
            counts = self._counts
            logits -= np.float32(self._frequency) * counts
            if self._presence:
                logits -= np.float32(self._presence) * (counts > 0)
        # A valid but extreme parameter (repetition_penalty 1e-300 divides by a float32 zero) must
        # give a finite logit, not inf: inf - inf is NaN and no distribution is left to draw from.
        np.clip(logits, -_LOGIT_LIMIT, _LOGIT_LIMIT, out=logits)

    def _truncate(self, logits: np.ndarray) -> np.ndarray:
        """Temperature, then top_k, top_p and min_p (vLLM's order); excluded tokens -> -inf."""
        if self._temperature == 0.0:
            return logits  # greedy: the argmax, unscaled
        scaled = logits / np.float32(self._temperature) if self._temperature != 1.0 else logits
        finite = np.isfinite(scaled)
        k = self._top_k
        if k and k < int(finite.sum()):
            kth = np.partition(scaled[finite], -k)[-k]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        if self._top_p < 1.0 or self._min_p > 0.0:
            probs = _softmax(scaled)
            keep = np.ones(scaled.size, dtype=bool)
            if self._min_p > 0.0:
                keep &= probs >= self._min_p * probs.max()
            if self._top_p < 1.0:
                order = np.argsort(-probs)
                cum = np.cumsum(probs[order])
                # Keep the smallest prefix whose mass reaches top_p (always the top token).
                cut = int(np.searchsorted(cum, self._top_p)) + 1
                top = np.zeros(scaled.size, dtype=bool)
                top[order[:cut]] = True
                keep &= top
            scaled = np.where(keep, scaled, -np.inf)
        return scaled

    def _draw(self, processed: np.ndarray) -> int:
        if self._temperature == 0.0:
            return int(np.argmax(processed))
        probs = _softmax(processed)
        return int(self._rng.choice(probs.size, p=probs))

    def _record_logprobs(self, processed: np.ndarray, token: int) -> None:
        logp = _log_softmax(processed)
        self.last_logprob = float(logp[token])
        n = self.num_top or 0
        if n <= 0:
            self.last_top = None
            return
        finite = int(np.isfinite(logp).sum())
        n = min(n, finite)
        best = np.argpartition(-logp, n - 1)[:n]
        best = best[np.argsort(-logp[best], kind="stable")]
        self.last_top = [(int(t), float(logp[t])) for t in best]


_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
_LOGIT_LIMIT = np.float32(1e30)  # finite in float32, and far beyond any real logit


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - np.max(x), dtype=np.float64)
    return z / z.sum()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    shifted = x.astype(np.float64) - m
    return shifted - np.log(np.exp(shifted).sum())


def _check_ids(ids: np.ndarray, vocab_size: int, param: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise InvalidRequestError(f"{param}: token id {bad} is out of the vocabulary (size {vocab_size})", param=param)
