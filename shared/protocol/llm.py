"""The ``generate`` endpoint's wire types (msgpack on the request plane).

The frontend tokenizes and applies the chat template, so workers receive token ids and return token
ids; detokenization and stop strings stay in the frontend. Responses are a stream of
``EngineOutput`` frames; the last one has ``finish_reason`` and ``usage``.
"""

from __future__ import annotations

import msgspec


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    logprobs: int | None = None  # number of top logprobs wanted; None: none


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class SlaTargets(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The client's latency targets in ms (``nvext.router``, Dynamo's names): the global router
    picks a pool by them; other routers and engines ignore them."""

    ttft_target: float | None = None
    itl_target: float | None = None


class RoutingHints(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Routing hints from ``nvext.agent_hints`` (Dynamo's ``routing``): ``priority`` selects the
    global router's priority overrides."""

    priority: int | None = None


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    lora_name: str | None = None
    # Prefill/decode disaggregation: set on a prefill-only request / carried to the decode worker.
    prefill_only: bool = False
    disaggregated_params: dict | None = None
    estimated_prefix_hit_blocks: int | None = None
    dp_rank: int | None = None
    router: SlaTargets | None = None
    routing: RoutingHints | None = None


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    token_ids: list[int] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    log_probs: list[float] | None = None
    usage: Usage | None = None
    disaggregated_params: dict | None = None
    error: str | None = None


FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
