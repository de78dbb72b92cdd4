"""Our request and response types <-> vLLM's ``SamplingParams`` and ``RequestOutput``.

Plain functions over plain values (no vLLM import), so the mapping is tested without an engine:
``sampling_kwargs`` builds the keyword arguments for ``vllm.SamplingParams``; ``OutputTracker``
turns the delta ``RequestOutput``s of one request into ``EngineOutput`` frames and its usage (and,
on a prefill leg's final frame, the connector's ``kv_transfer_params`` as ``disaggregated_params``).

The frontend tokenizes, detokenizes and applies stop strings, so the engine is asked for token ids
only (``detokenize=False``) and in deltas; only stop *token ids* reach it. Sampling values the
request leaves unset take the model's own defaults (vLLM reads them from generation_config.json,
as its OpenAI server does), then vLLM's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dynamod.daemon.engines.common.sampling import stop_kwargs
from dynamod.shared.protocol.llm import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    GuidedDecoding,
    PreprocessedRequest,
    Usage,
)

logger = logging.getLogger(__name__)

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT, "error": FINISH_ERROR}
# SamplingOptions fields that are SamplingParams arguments of the same name and meaning.
_SAMPLING_NAMES = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
)


def sampling_kwargs(
    request: PreprocessedRequest,
    *,
    context_length: int,
    model_defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``SamplingParams`` (without ``output_kind``, which the caller adds)."""
    s = request.sampling
    out: dict[str, Any] = {}
    defaults = dict(model_defaults or {})
    for name in _SAMPLING_NAMES:
        value = getattr(s, name)
        if value is not None:
            out[name] = value
        elif name in defaults:
            out[name] = defaults[name]
    # Model defaults other than the ones above also apply.
    for name, value in defaults.items():
        if name not in out and name not in ("max_tokens",):
            out[name] = value
    if out.get("top_k") == -1:
        out["top_k"] = 0  # older generation configs use -1 for "off"; vLLM now uses 0
    if s.logit_bias:
        out["logit_bias"] = dict(s.logit_bias)
    if s.allowed_token_ids is not None:
        out["allowed_token_ids"] = list(s.allowed_token_ids)
    guided = s.guided_decoding
    if guided is not None:
        out["structured_outputs"] = structured_outputs_kwargs(guided)
    out.update(stop_kwargs(request, context_length=context_length))
    if s.logprobs is not None:
        out["logprobs"] = s.logprobs
    out["detokenize"] = False
    out["n"] = 1
    return out


def structured_outputs_kwargs(guided: GuidedDecoding) -> dict[str, Any]:
    """Keyword arguments for ``vllm.sampling_params.StructuredOutputsParams`` (the caller builds
    it: this module imports nothing of vLLM)."""
    out: dict[str, Any] = {}
    kind = guided.kind
    if kind == "json":
        out["json"] = guided.json
        if guided.whitespace_pattern is not None:
            out["whitespace_pattern"] = guided.whitespace_pattern
    elif kind == "regex":
        out["regex"] = guided.regex
    elif kind == "choice":
        out["choice"] = list(guided.choice or [])
    else:
        out["grammar"] = guided.grammar
    return out


def finish_reason(reason: str | None) -> str | None:
    """vLLM's finish reason as ours ("stop" for anything unknown but final)."""
    if reason is None:
        return None
    return _FINISH.get(reason, FINISH_STOP)


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float] | None:
    """The log probability of each sampled token from vLLM's per-position dicts
    (``{token_id: Logprob}``), or None when the request asked for none."""
    if not logprobs:
        return None
    out: list[float] = []
    for token, position in zip(token_ids, logprobs, strict=False):
        entry = position.get(token) if isinstance(position, Mapping) else None
        value = getattr(entry, "logprob", entry)
        out.append(float(value) if value is not None else float("-inf"))
    return out


def top_logprobs(token_ids: list[int], logprobs: Any, num_top: int) -> list[list[tuple[int, float]]] | None:
    """Each position's ``num_top`` most likely tokens as (token id, logprob), best first, from
    vLLM's per-position dicts (which hold the top ones, by ``rank``, plus the sampled token)."""
    if not logprobs or num_top <= 0:
        return None
    out: list[list[tuple[int, float]]] = []
    for _, position in zip(token_ids, logprobs, strict=False):
        ranked = []
        if isinstance(position, Mapping):
            for token, entry in position.items():
                rank = getattr(entry, "rank", None)
                value = getattr(entry, "logprob", entry)
                if value is None:
                    continue
                ranked.append((rank if isinstance(rank, int) else num_top + 1, int(token), float(value)))
        ranked.sort(key=lambda r: (r[0], -r[2]))
        out.append([(token, value) for _, token, value in ranked[:num_top]])
    return out


class OutputTracker:
    """Maps one request's delta outputs; keeps the counts its final usage needs. ``num_top``: the
    top logprobs per token the request asked for (0: none). ``pin_refused``: the request asked for
    a pinned prefix (``cache_control``), which vLLM cannot give: its API (0.32) has no per-request
    pin or TTL (``SamplingParams`` and ``AsyncLLM.generate`` take none; the block pool's references
    are internal), so the usage says nothing was pinned. ``prompt_tokens`` starts as the frontend's
    count and becomes vLLM's own if its output says otherwise (a prompt with images whose placeholder
    expansion vLLM's processor did differently: logged, since the router's block keys then differ)."""

    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "num_top", "pin_refused")

    def __init__(self, prompt_tokens: int, num_top: int = 0, pin_refused: bool = False) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.num_top = num_top
        self.pin_refused = pin_refused

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            pin_refused=self.pin_refused,
        )

    def map(self, output: Any) -> EngineOutput | None:
        """One vLLM ``RequestOutput`` (delta kind) as an ``EngineOutput``; None if it carries
        nothing to send (no new token and not final)."""
        if output.num_cached_tokens:
            self.cached_tokens = int(output.num_cached_tokens)
        engine_prompt = getattr(output, "prompt_token_ids", None)
        if engine_prompt and len(engine_prompt) != self.prompt_tokens:
            logger.warning("vllm prompt length differs from the frontend's frontend=%d engine=%d "
                           "effect=usage_reports_engine_count", self.prompt_tokens, len(engine_prompt))
            self.prompt_tokens = len(engine_prompt)
        completion = output.outputs[0] if output.outputs else None
        token_ids = list(completion.token_ids) if completion is not None else []
        self.completion_tokens += len(token_ids)
        reason = finish_reason(completion.finish_reason if completion is not None else None)
        if reason is None and output.finished:
            reason = FINISH_STOP
        if not token_ids and reason is None:
            return None
        out = EngineOutput(token_ids=token_ids, finish_reason=reason)
        if completion is not None:
            lp = sampled_logprobs(token_ids, completion.logprobs)
            if lp is not None:
                out.log_probs = lp
                out.top_logprobs = top_logprobs(token_ids, completion.logprobs, self.num_top)
        if reason is not None:
            out.usage = self.usage()
            # A prefill leg's final output carries its KV connector's transfer parameters.
            params = getattr(output, "kv_transfer_params", None)
            if params:
                out.disaggregated_params = dict(params)
        return out

    def aborted(self) -> EngineOutput:
        return EngineOutput(finish_reason=FINISH_ABORT, usage=self.usage())
