"""The ``generate`` endpoint's wire types (msgpack on the request plane).

The frontend tokenizes and applies the chat template, so workers receive token ids and return token
ids; detokenization and stop strings stay in the frontend. Responses are a stream of
``EngineOutput`` frames; the last one has ``finish_reason`` and ``usage``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamod.shared.protocol.encode import EmbeddingParams


class GuidedDecoding(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One output constraint (structured outputs): exactly one of ``json`` (a JSON schema; ``{"type":
    "object"}`` for ``response_format: json_object``), ``regex``, ``choice`` or ``grammar`` (EBNF/GBNF
    or Lark) is set. The frontend has checked that it compiles, so an engine can trust it; the names
    are vLLM's ``StructuredOutputsParams`` and Dynamo's ``guided_decoding``."""

    json: Any = None  # a JSON schema: an object or a boolean
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None

    @property
    def kind(self) -> str:
        """Which constraint is set: ``json``, ``regex``, ``choice`` or ``grammar``."""
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        return "grammar"


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens; unset (None) values take the engine's or the model's defaults. Every
    field reaches the engine: an engine that cannot honour one refuses the request."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    logprobs: int | None = None  # number of top logprobs wanted (0: the sampled token's only); None: none
    guided_decoding: GuidedDecoding | None = None


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
    """Routing hints from ``nvext.agent_hints`` (Dynamo's ``routing``).

    ``priority`` is Dynamo's request priority: higher is more urgent, 0 (or unset) the default,
    negative is background work. It picks the global router's priority overrides, orders the KV
    router's wait queue (daemon/router/core/wait_queue.py) and reaches the engines' priority
    scheduling; an engine whose own convention differs converts it (vLLM and the mocker schedule
    lower values first, so they get ``engine_priority``)."""

    priority: int | None = None


# The bounded set of ``priority_class`` metric label values: one series per class, not per integer.
PRIORITY_HIGH = "high"
PRIORITY_NORMAL = "normal"
PRIORITY_LOW = "low"
PRIORITY_CLASSES = (PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW)


def priority_class(priority: int | None) -> str:
    """``high`` above 0, ``normal`` at 0 or unset, ``low`` below 0 (Dynamo's polarity)."""
    if not priority:
        return PRIORITY_NORMAL
    return PRIORITY_HIGH if priority > 0 else PRIORITY_LOW


def engine_priority(priority: int | None) -> int:
    """Dynamo's priority in vLLM's convention (``AsyncLLM.generate(priority=)``, the mocker's
    scheduler): lower values are scheduled first, so the sign flips."""
    return -priority if priority else 0


class PrefixPin(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Keep the prompt's first ``num_tokens`` tokens cached on the worker for ``ttl_s`` seconds
    (Anthropic's ``cache_control``, ``nvext.cache_control``): the frontend counts the tokens after
    the chat template. Engines pin whole blocks (a trailing partial block is not pinned); one that
    cannot pin ignores it. A later pin of the same prefix extends it."""

    num_tokens: int
    ttl_s: float


class MultimodalItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image of a prompt, as the frontend's processor expanded it (vLLM's ``MultiModalFeatureSpec``:
    ``identifier`` and ``mm_position``). ``token_ids[offset : offset + length]`` are its placeholder
    tokens; ``mm_hash`` is its content hash (hex, daemon/frontend/preprocess/media/image.py), which
    the blocks covering those tokens mix into their block hash (shared/kv/hashing.py), so a repeated
    image is a prefix-cache hit and another image of the same size at the same place is a miss.
    ``width``/``height``: the size the encoder sees after the processor's resize."""

    mm_hash: str
    offset: int
    length: int
    modality: str = "image"
    width: int = 0
    height: int = 0
    # The image file's bytes as the client sent them (PNG, JPEG, WebP or GIF, already checked by
    # the frontend's decode), for whoever encodes it: an encode worker, or an engine that runs its
    # own vision tower (vLLM, SGLang, TensorRT-LLM), which decodes them and resizes to
    # ``width``x``height``. Empty when the frontend did not keep them (replayed traces, the mocker).
    data: bytes = b""
    # Set when an encode worker holds this image's embedding (shared/protocol/encode.py): the
    # prefill/agg worker reads it instead of encoding; None: the worker encodes the image itself.
    embedding: EmbeddingParams | None = None


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
    pin: PrefixPin | None = None  # cache_control: keep this prompt prefix cached for a while
    mm_items: list[MultimodalItem] | None = None  # the prompt's images, in prompt order

    @property
    def priority(self) -> int:
        """The request's Dynamo priority (``routing.priority``; 0 when unset)."""
        routing = self.routing
        return 0 if routing is None or routing.priority is None else routing.priority


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # ``PreprocessedRequest.pin``: prompt tokens this request newly pinned beyond ``cached_tokens``
    # (Anthropic's cache_creation_input_tokens), and whether the pin was refused (the worker's
    # pinned share of its cache was full, or its engine cannot pin: vLLM; the request ran unpinned).
    pinned_tokens: int = 0
    pin_refused: bool = False


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    token_ids: list[int] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    log_probs: list[float] | None = None
    # Per token in ``token_ids``: the most likely alternatives as (token id, logprob), best first
    # (``SamplingOptions.logprobs`` of them); only when top logprobs were asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    usage: Usage | None = None
    disaggregated_params: dict | None = None
    error: str | None = None


FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
