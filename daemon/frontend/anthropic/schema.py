"""Anthropic Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``) as msgspec structs.

Requests follow the frontend's strictness policy (``pipeline/body.py``): decoded and validated in
one pass, an unknown field is a 400 naming it. Every field Anthropic documents for these two
endpoints is accepted. Those that describe the caller, its billing or the prompt cache and change
nothing about the output (``metadata``, ``service_tier``, ``speed``, ``inference_geo``,
``diagnostics``, ``user_profile_id``, ``workspace_id``) are accepted and not used
(``ACCEPTED_UNUSED``); ``cache_control`` (on blocks, tools or the request) pins the prompt prefix
on the worker (``cache_control.py``); those that ask for something this server cannot do (``container``,
``mcp_servers``, ``context_management``) are refused by name when set, in ``convert.py``.

Content blocks are tagged unions on ``type``: text, image, document, tool_use, tool_result,
thinking, redacted_thinking. Tools stay plain objects here so that a server tool (``web_search``,
``bash``...) is refused with a message naming it rather than as an unknown field.

Responses (the message, its content blocks, usage) and the streaming events are plain structs,
encoded once with a shared encoder.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from dynamod.daemon.frontend.openai.schema import NvExt
from dynamod.daemon.frontend.pipeline.body import RequestBody, decode_body

_I32 = 2**31 - 1

MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=_I32)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # Anthropic's range (OpenAI's goes to 2)
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=0, le=_I32)]
ThinkingBudget = Annotated[int, msgspec.Meta(ge=1024, le=_I32)]  # "at least 1,024"

ACCEPTED_UNUSED = (
    "metadata", "service_tier", "speed", "inference_geo", "diagnostics", "user_profile_id", "workspace_id",
)

UNKNOWN_FIELD_HINTS = {
    "stop": "use 'stop_sequences'",
    "max_completion_tokens": "use 'max_tokens'",
    "max_tokens_to_sample": "that is the legacy Text Completions API; use 'max_tokens'",
    "prompt": "that is the legacy Text Completions API; send 'messages'",
    "n": "one message per request",
}


class CacheControl(RequestBody, kw_only=True):
    """``cache_control`` on a block, a tool or the request: pin the prompt prefix up to there for
    ``ttl`` (5 minutes by default; ``cache_control.py``)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# -- content blocks ---------------------------------------------------------------------------------


class TextBlockParam(RequestBody, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ImageBlockParam(RequestBody, kw_only=True, tag_field="type", tag="image"):
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlockParam(RequestBody, kw_only=True, tag_field="type", tag="document"):
    source: dict[str, Any]
    cache_control: CacheControl | None = None
    citations: Any = None
    context: str | None = None
    title: str | None = None


class SearchResultBlockParam(RequestBody, kw_only=True, tag_field="type", tag="search_result"):
    source: str
    title: str
    content: list[TextBlockParam]
    cache_control: CacheControl | None = None
    citations: Any = None


class ToolUseBlockParam(RequestBody, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Any = None


ToolResultPart = TextBlockParam | ImageBlockParam | DocumentBlockParam | SearchResultBlockParam


class ToolResultBlockParam(RequestBody, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlockParam(RequestBody, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(RequestBody, kw_only=True, tag_field="type", tag="redacted_thinking"):
    data: str


ContentBlockParam = (
    TextBlockParam | ImageBlockParam | DocumentBlockParam | SearchResultBlockParam | ToolUseBlockParam
    | ToolResultBlockParam | ThinkingBlockParam | RedactedThinkingBlockParam
)


class MessageParam(RequestBody, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


# -- tool choice, thinking, output ------------------------------------------------------------------


class ToolChoiceAuto(RequestBody, kw_only=True, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestBody, kw_only=True, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestBody, kw_only=True, tag_field="type", tag="tool"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestBody, kw_only=True, tag_field="type", tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(RequestBody, kw_only=True, tag_field="type", tag="enabled"):
    budget_tokens: ThinkingBudget
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(RequestBody, kw_only=True, tag_field="type", tag="adaptive"):
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(RequestBody, kw_only=True, tag_field="type", tag="disabled"):
    pass


ThinkingConfig = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class JsonOutputFormat(RequestBody, kw_only=True):
    """``output_config.format``: the reply is JSON matching ``schema`` (structured outputs)."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(RequestBody, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(RequestBody, kw_only=True):
    user_id: str | None = None


# -- the requests -----------------------------------------------------------------------------------


class CountTokensRequest(RequestBody, kw_only=True):
    """``POST /v1/messages/count_tokens``: the conversation without the generation settings."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Refused when set (convert.py): nothing here runs them.
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    cache_control: CacheControl | None = None  # the whole prompt (the last block) is the prefix to pin
    # ACCEPTED_UNUSED
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: MaxTokens
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None
    container: Any = None  # refused when set
    # ACCEPTED_UNUSED
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: Any = None
    # Dynamo's extension block, as on OpenAI requests (routing hints, ignore_eos, guided decoding).
    nvext: NvExt | None = None


_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


def decode_messages_request(body: bytes) -> MessagesRequest:
    return decode_body(_messages_decoder, body, UNKNOWN_FIELD_HINTS)  # type: ignore[no-any-return]


def decode_count_tokens_request(body: bytes) -> CountTokensRequest:
    return decode_body(_count_decoder, body, UNKNOWN_FIELD_HINTS)  # type: ignore[no-any-return]


# -- responses --------------------------------------------------------------------------------------


class Usage(msgspec.Struct):
    """Anthropic counts the prompt in three parts: ``input_tokens`` is what was neither read from
    nor written to the prompt cache; ``cache_read_input_tokens`` is the prefix the worker had;
    ``cache_creation_input_tokens`` the tokens after it that this request's ``cache_control``
    newly pinned (0 when the worker refused the pin: its pinned share was full)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # no signature: these are the model's own tokens, not Anthropic's


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Message(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class TokensCount(msgspec.Struct):
    input_tokens: int


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag_field="type", tag="error"):
    """``{"type": "error", "error": {"type", "message"}, "request_id"}``: the body of every error,
    and the data of the stream's ``error`` event."""

    error: ErrorDetail
    request_id: str | None = None


# -- streaming events (each an SSE ``event: <type>`` line and its ``data``) -----------------------------


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopInfo
    usage: Usage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


Event = (
    MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | ErrorBody
)

encoder = msgspec.json.Encoder()
