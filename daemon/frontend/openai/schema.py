"""OpenAI request and response bodies as msgspec structs.

Requests are decoded and validated in one pass (``msgspec.json.decode(body, type=...)``), so a
wrong type or an out-of-range number becomes a 400 naming the parameter, and no value that the
request plane cannot carry (an integer beyond 64 bits, a NaN) gets past the door. Every integer has
an upper bound for that reason. An unknown field is a 400 naming it, as the OpenAI API answers
("Unrecognized request argument supplied"): a misspelt ``max_token`` or a ``chat_template`` we would
not apply must not be served as if it had been honoured. OpenAI's bookkeeping fields that change
nothing about the output (``store``, ``metadata``, ``service_tier``, ``user``, ...) are accepted and
documented as such in ``ACCEPTED_UNUSED``.

Responses are plain structs encoded once per chunk with a shared encoder: no per-token model
validation on the hot path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from dynamod.daemon.frontend.pipeline.body import RequestBody, decode_body
from dynamod.daemon.frontend.pipeline.routing import SessionRef
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import PrefixPin, RoutingHints, SlaTargets

_I32 = 2**31 - 1
_I64 = 2**63 - 1

MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=_I32)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=_I32)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=_I32)]
Seed = Annotated[int, msgspec.Meta(ge=-_I64 - 1, le=_I64)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=100.0)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
ChoiceCount = Annotated[int, msgspec.Meta(ge=1, le=128)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=_I32)]
LatencyTargetMs = Annotated[float, msgspec.Meta(ge=0.0, le=86_400_000.0)]
Priority = Annotated[int, msgspec.Meta(ge=-_I32 - 1, le=_I32)]

MAX_STOP_SEQUENCES = 16

# OpenAI request fields accepted and not used: they describe the caller or its billing, not the
# output, so serving the request without them is what the caller asked for.
ACCEPTED_UNUSED = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")

# Unknown fields a client is likely to send, and what to do instead (the 400's message says it).
UNKNOWN_FIELD_HINTS = {
    "chat_template": "the served model's own chat template applies; pass its variables in 'chat_template_kwargs'",
    "functions": "use 'tools'",
    "function_call": "use 'tool_choice'",
    "max_token": "did you mean 'max_tokens'?",
    # vLLM's own server takes a top-level ``priority`` (lower first); Dynamo's is under nvext.
    "priority": "the request priority is 'nvext.agent_hints.priority' (higher is more urgent) or the "
    "x-dynamo-request-priority header",
}


class StreamOptions(RequestBody, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class NvExtRouter(RequestBody, kw_only=True):
    """``nvext.router``: latency targets in ms, read by the global router to pick a pool."""

    ttft_target: LatencyTargetMs | None = None
    itl_target: LatencyTargetMs | None = None


class AgentHints(RequestBody, kw_only=True):
    """``nvext.agent_hints``: ``priority`` (Dynamo's: higher is more urgent) orders the KV router's
    queue, reaches the engines' priority scheduling and picks the global router's overrides."""

    priority: Priority | None = None


SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
SessionTimeout = Annotated[int, msgspec.Meta(ge=1, le=31_536_000)]


class SessionControl(RequestBody, kw_only=True):
    """``nvext.session_control`` (Dynamo's): the session for affinity; ``timeout`` its idle
    seconds (default the router's TTL); ``action: "close"`` ends the binding with this request
    (``open`` is accepted: a session opens on its first request anyway)."""

    session_id: SessionId
    action: Literal["open", "close"] | None = None
    timeout: SessionTimeout | None = None


PIN_TTL_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_PIN_TTL_S = 3600  # Anthropic's longest cache TTL
DEFAULT_PIN_TTL_S = 300  # Anthropic's and Dynamo's default, 5 minutes
PrefixTokens = Annotated[int, msgspec.Meta(ge=1, le=_I32)]


def pin_ttl_seconds(ttl: str | None, param: str) -> float:
    """``"30s"``, ``"5m"``, ``"1h"`` (an integer and a unit, up to an hour) in seconds; None: 5 minutes."""
    if ttl is None:
        return float(DEFAULT_PIN_TTL_S)
    unit = PIN_TTL_UNITS.get(ttl[-1:]) if ttl[:-1].isdigit() else None
    seconds = int(ttl[:-1]) * unit if unit is not None else 0
    if not 1 <= seconds <= MAX_PIN_TTL_S:
        raise InvalidRequestError(
            f"{param}: {ttl!r} is not a TTL; use an integer with s, m or h, from 1s to 1h (e.g. \"5m\")", param=param
        )
    return float(seconds)


class NvExtCacheControl(RequestBody, kw_only=True):
    """``nvext.cache_control`` (the spelling of Dynamo's prefix pinning, Anthropic's object): keep
    this request's prompt cached on its worker for ``ttl``; ``prefix_tokens`` pins only the first
    that many prompt tokens (default the whole prompt). Workers pin whole KV blocks."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None
    prefix_tokens: PrefixTokens | None = None


class NvExt(RequestBody, kw_only=True):
    """Dynamo's request extension block; ``ignore_eos`` also works at the top level."""

    ignore_eos: bool | None = None
    router: NvExtRouter | None = None
    agent_hints: AgentHints | None = None
    session_control: SessionControl | None = None
    session_id: SessionId | None = None  # shorthand for session_control.session_id
    cache_control: NvExtCacheControl | None = None  # pin the prompt prefix on the worker
    # Dynamo's guided decoding under nvext (the same meaning as the top-level guided_* fields).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: Any = None

    def sla_targets(self) -> SlaTargets | None:
        """The targets for ``PreprocessedRequest.router`` (None: the client set none)."""
        r = self.router
        if r is None or (r.ttft_target is None and r.itl_target is None):
            return None
        return SlaTargets(ttft_target=r.ttft_target, itl_target=r.itl_target)

    def routing_hints(self) -> RoutingHints | None:
        """The hints for ``PreprocessedRequest.routing`` (None: the client set none)."""
        h = self.agent_hints
        return None if h is None or h.priority is None else RoutingHints(priority=h.priority)

    def prefix_pin(self, prompt_len: int) -> PrefixPin | None:
        """The pin for ``PreprocessedRequest.pin`` (None: no ``cache_control``); a bad TTL is a 400."""
        cc = self.cache_control
        if cc is None:
            return None
        ttl_s = pin_ttl_seconds(cc.ttl, "nvext.cache_control.ttl")
        n = prompt_len if cc.prefix_tokens is None else min(cc.prefix_tokens, prompt_len)
        return PrefixPin(num_tokens=n, ttl_s=ttl_s)

    def session(self) -> SessionRef | None:
        """The session for affinity (None: none named); the ``x-dynamo-session-id`` header wins."""
        control = self.session_control
        if control is None:
            return None if self.session_id is None else SessionRef(self.session_id)
        if self.session_id is not None and self.session_id != control.session_id:
            raise InvalidRequestError(
                "nvext.session_id and nvext.session_control.session_id name different sessions", param="nvext.session_id"
            )
        return SessionRef(
            control.session_id, ttl_s=None if control.timeout is None else float(control.timeout), close=control.action == "close"
        )


class JsonSchemaFormat(RequestBody, kw_only=True):
    """``response_format.json_schema``: the schema under ``schema`` (vLLM also reads ``json_schema``)."""

    name: str | None = None
    description: str | None = None
    schema: Any = msgspec.field(default=None, name="schema")
    json_schema: Any = None
    strict: bool | None = None


class ResponseFormat(RequestBody, kw_only=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (vLLM's
    ``structural_tag`` is decoded so it can be refused by name)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestBody, kw_only=True):
    """vLLM's ``structured_outputs`` request field (its ``StructuredOutputsParams``)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    structural_tag: Any = None


class _SamplingFields(RequestBody, kw_only=True):
    model: str
    max_tokens: MaxTokens | None = None
    min_tokens: MinTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    # OpenAI accepts an explicit null for these; __post_init__ turns it into the default.
    n: ChoiceCount | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # vLLM's sampling extensions; daemon/frontend/openai/sampling.py turns these into ``SamplingOptions``.
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    logit_bias: dict[TokenId, LogitBias] | None = None  # JSON keys are token ids as strings
    allowed_token_ids: list[TokenId] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM fields no engine here can honour: decoded so that a non-default value is a 400 naming
    # it (sampling.py) rather than silently ignored as an unknown field would be.
    guided_decoding_backend: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    bad_words: Any = None
    # ACCEPTED_UNUSED
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    nvext: NvExt | None = None
    return_token_ids: bool | None = False  # vLLM's extension: each choice also carries its token ids

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1
        if self.stream is None:
            self.stream = False
        if self.ignore_eos is None:
            self.ignore_eos = False
        if self.return_token_ids is None:
            self.return_token_ids = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def wants_ignore_eos(self) -> bool:
        return self.ignore_eos or bool(self.nvext is not None and self.nvext.ignore_eos)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", param="stop")
        return [s for s in stops if s]


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[Any]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # checked in parsers/output.py (ToolSettings): it names functions in ``tools``
    parallel_tool_calls: bool | None = None  # False: at most one call per reply
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logprobs is None:
            self.logprobs = False
        if self.add_generation_prompt is None:
            self.add_generation_prompt = True

    def output_limit(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens`` when both are set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# msgspec allows one array type per union; the element types are checked in preprocess/model_preprocessor.py.
PromptValue = str | list[Any]


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: PromptValue
    logprobs: TopLogprobs | None = None
    echo: bool | None = False
    best_of: ChoiceCount | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.echo is None:
            self.echo = False

    def output_limit(self) -> int | None:
        return self.max_tokens


# ------------------------------------------------------------------------------------------------
# Responses.


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    # vLLM's name: prompt tokens after the cached ones that ``nvext.cache_control`` newly pinned;
    # only on responses to requests that asked for a pin.
    created_cache_tokens: int | msgspec.UnsetType = msgspec.UNSET


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatFunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatToolCall(msgspec.Struct):
    id: str
    function: ChatFunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """``content`` is always present (null when the reply is only tool calls); the other two only
    when the model's output parsers produced them."""

    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ChatFunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ChatToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One piece of a streamed tool call: the first piece of a call has ``id``, ``type`` and the
    function's name; later ones only the next part of its ``arguments``."""

    index: int
    function: ChatFunctionDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatChunkChoiceTokens(ChatChunkChoice):
    token_ids: list[int] = []


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"


class ChatCompletionChunkWithUsage(msgspec.Struct):
    """A chunk when ``stream_options.include_usage`` is on: ``usage`` is null until the last one."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionChoiceTokens(CompletionChoice):
    token_ids: list[int] = []


class ChatChoiceTokens(ChatChoice):
    token_ids: list[int] = []


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"


class CompletionChunkWithUsage(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    object: str = "text_completion"


class ModelObject(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "dynamod"
    object: str = "model"
    parent: str | None = None
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelObject]
    object: str = "list"


# ------------------------------------------------------------------------------------------------
# Decoding.

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
def decode_json_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """An OpenAI body, decoded by ``pipeline/body.py`` with this surface's unknown-field hints."""
    return decode_body(decoder, body, UNKNOWN_FIELD_HINTS)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    return decode_json_body(_chat_decoder, body)


def decode_completion_request(body: bytes) -> CompletionRequest:
    return decode_json_body(_completion_decoder, body)


encoder = msgspec.json.Encoder()


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: a string, a token list, or a batch of either."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("'prompt' must not be empty", param="prompt")
    if all(is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param="prompt",
    )


def is_token_id(value: object) -> bool:
    """A token id as a request may give it (an int in the 31-bit range; not a bool)."""
    return type(value) is int and 0 <= value < 2**31
