"""Our requests and responses <-> SGLang's ``async_generate`` arguments and output dicts.

The engine runs with ``skip_tokenizer_init`` (token ids in, token ids out: the frontend owns the
tokenizer) and ``stream_output`` (each streamed dict carries only the new ``output_ids``).
``meta_info`` has ``finish_reason`` (``None`` or ``{"type": "stop"|"length"|"abort", ...}``),
``prompt_tokens``, ``completion_tokens`` and, with ``enable_cache_report``, ``cached_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dynamod.daemon.engines.common.sampling import choice_grammar, refuse_unsupported, stop_kwargs
from dynamod.shared.protocol.llm import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    PreprocessedRequest,
    Usage,
)

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


def sampling_params(request: PreprocessedRequest, *, context_length: int, model_defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict; unset values fall back to the model's defaults."""
    s = request.sampling
    defaults = dict(model_defaults or {})
    out: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed")):
        value = getattr(s, ours)
        if value is None:
            value = defaults.get(ours)
        if value is not None:
            out[theirs] = value
    if out.get("top_k") == 0:
        out["top_k"] = -1  # SGLang's "off" is -1
    refuse_unsupported(request, ("allowed_token_ids",), "SGLang")
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(s, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            out[name] = value
    if s.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
    guided = s.guided_decoding
    if guided is not None:
        kind = guided.kind
        if kind == "json":
            out["json_schema"] = json.dumps(guided.json)
        elif kind == "regex":
            out["regex"] = guided.regex
        elif kind == "choice":
            out["ebnf"] = choice_grammar(guided.choice or [])
        else:
            out["ebnf"] = guided.grammar
    out.update(stop_kwargs(request, context_length=context_length, max_key="max_new_tokens", min_key="min_new_tokens"))
    return out


def top_logprobs(meta: Mapping[str, Any], num_tokens: int) -> list[list[tuple[int, float]]] | None:
    """The new tokens' alternatives from ``meta_info["output_top_logprobs"]`` (per position a
    list of ``(logprob, token_id, text)``), as (token id, logprob) best first."""
    tops = meta.get("output_top_logprobs")
    if not tops or not num_tokens:
        return None
    out = []
    for position in tops[-num_tokens:]:
        entries = [(int(e[1]), float(e[0])) for e in position or [] if e[0] is not None]
        entries.sort(key=lambda e: -e[1])
        out.append(entries)
    return out


def finish_reason(meta: Mapping[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    return _FINISH.get(str(kind), FINISH_STOP)


class SglangOutputTracker:
    """Maps one request's streamed dicts; keeps what the final usage needs."""

    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "rid")

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.rid: str | None = None

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                     completion_tokens=self.completion_tokens)

    def map(self, chunk: Mapping[str, Any]) -> EngineOutput | None:
        meta = chunk.get("meta_info") or {}
        self.rid = meta.get("id", self.rid)
        tokens = [int(t) for t in chunk.get("output_ids") or []]
        self.completion_tokens += len(tokens)
        if meta.get("cached_tokens"):
            self.cached_tokens = int(meta["cached_tokens"])
        if meta.get("prompt_tokens"):
            self.prompt_tokens = int(meta["prompt_tokens"])
        reason = finish_reason(meta)
        if not tokens and reason is None:
            return None
        out = EngineOutput(token_ids=tokens, finish_reason=reason)
        logprobs = meta.get("output_token_logprobs")
        if logprobs and tokens:
            out.log_probs = [float(entry[0]) for entry in logprobs[-len(tokens):]]
            out.top_logprobs = top_logprobs(meta, len(tokens))
        if reason is not None:
            if meta.get("completion_tokens") is not None:
                self.completion_tokens = int(meta["completion_tokens"])
            out.usage = self.usage()
        return out

    def aborted(self) -> EngineOutput:
        return EngineOutput(finish_reason=FINISH_ABORT, usage=self.usage())
