"""An Anthropic Messages request -> the chat request the pipeline serves.

As with the Responses API, the conversation is rewritten in the message shape chat templates know
(OpenAI's), so the chat pipeline serves it unchanged: the template and tokenizer, the budget, the
sampling options, the tool-call and reasoning parsers, and the guided decoding that enforces a
forced tool call. ``AnthropicChatRequest`` is a real ``ChatCompletionRequest`` carrying the
original request for the response side.

    system (string or text blocks)           -> a leading system message
    user text blocks                         -> a user message (blocks joined by newlines)
    user image blocks (base64 or url source) -> image_url parts of that message, in order with its
                                                 text (a data: URL, or the URL, which the frontend
                                                 fetches only from --allowed-media-domains hosts);
                                                 a text-only model answers them with a 400
    user tool_result blocks                  -> tool messages (tool_call_id = tool_use_id), before the
                                                 user's text, as the results answer the previous turn
    assistant text / thinking / tool_use     -> an assistant message with content, reasoning_content
                                                 and tool_calls (arguments = the input as JSON)
    tools [{name, description, input_schema}] -> function tools
    tool_choice auto / any / tool / none     -> auto / required / the named function / none
    disable_parallel_tool_use                -> parallel_tool_calls false
    thinking enabled|adaptive / disabled     -> chat_template_kwargs enable_thinking true / false
    output_config.effort / .format           -> reasoning_effort / response_format json_schema
    stop_sequences, temperature, top_p, top_k, max_tokens, metadata.user_id -> the chat fields

Refused with a 400 naming the block or field: documents (no model here reads them), images inside
a tool_result, an image source other than base64 or url, server tools, a final assistant message (prefill: the templates here cannot continue a turn),
``container``, ``mcp_servers`` and ``context_management``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from dynamod.daemon.frontend.anthropic.schema import (
    CacheControl,
    CountTokensRequest,
    DocumentBlockParam,
    ImageBlockParam,
    MessagesRequest,
    RedactedThinkingBlockParam,
    SearchResultBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingDisabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from dynamod.daemon.frontend.openai.schema import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    JsonSchemaFormat,
    ResponseFormat,
)
from dynamod.daemon.frontend.preprocess.media.parts import IMAGE_PART_TYPE, WHERE_KEY
from dynamod.shared.errors import InvalidRequestError

CUSTOM_TOOL_TYPES = (None, "custom")
# The image types Anthropic's API accepts in a base64 source.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class AnthropicChatRequest(ChatCompletionRequest, kw_only=True):
    """The chat request the pipeline serves, with the Anthropic request it came from."""

    anthropic: CountTokensRequest | None = None


def _unsupported_media(block: Any, where: str) -> InvalidRequestError:
    if isinstance(block, ImageBlockParam):
        why = "image blocks are not supported inside a tool_result: put the image in the user's content"
    else:
        why = "document blocks are not supported: the models served here do not read documents"
    return InvalidRequestError(f"{where}: {why}", param=where)


def _image_part(block: ImageBlockParam, where: str) -> dict[str, Any]:
    """An image block as the chat pipeline's ``image_url`` part; its place in the Anthropic
    request rides along (``WHERE_KEY``) so a bad image's 400 names ``messages[i].content[j]``."""
    source = block.source
    kind = source.get("type")
    here = f"{where}.source"
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise InvalidRequestError(
                f"{here}.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}, got {media_type!r}", param=here
            )
        if not isinstance(data, str) or not data:
            raise InvalidRequestError(f"{here}.data must be a non-empty base64 string", param=here)
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{here}.url must be a non-empty string", param=here)
    else:
        raise InvalidRequestError(f"{here}.type {kind!r} is not supported: use base64 or url", param=here)
    return {"type": IMAGE_PART_TYPE, "image_url": {"url": url}, WHERE_KEY: where}


def _text_parts(parts: list[Any], where: str) -> str:
    """Text of a tool result's or a search result's content blocks, joined by newlines."""
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, TextBlockParam):
            texts.append(part.text)
        elif isinstance(part, SearchResultBlockParam):
            texts.append("\n".join([part.title, *(p.text for p in part.content)]))
        else:
            raise _unsupported_media(part, f"{where}[{j}]")
    return "\n".join(texts)


def _tool_result(block: ToolResultBlockParam, where: str) -> dict[str, Any]:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _text_parts(content, f"{where}.content")
    if block.is_error:
        text = f"Error: {text}" if text else "Error"  # what the template cannot otherwise show
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _user_messages(content: list[Any], where: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, used when there is an image
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        if isinstance(block, TextBlockParam | SearchResultBlockParam):
            text = block.text if isinstance(block, TextBlockParam) else _text_parts([block], here)
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif isinstance(block, ToolResultBlockParam):
            results.append(_tool_result(block, here))
        elif isinstance(block, ImageBlockParam):
            parts.append(_image_part(block, here))
        elif isinstance(block, DocumentBlockParam):
            raise _unsupported_media(block, here)
        else:
            raise InvalidRequestError(f"{here}: a {_block_type(block)} block belongs to an assistant message", param=here)
    if len(parts) > len(texts):
        return results + [{"role": "user", "content": parts}]
    user = [{"role": "user", "content": "\n".join(texts)}] if texts else []
    return results + user


def _assistant_message(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlockParam):
            reasoning.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlockParam):
            continue  # encrypted by Anthropic: nothing a template here could show
        elif isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ImageBlockParam | DocumentBlockParam):
            raise _unsupported_media(block, here)
        else:
            raise InvalidRequestError(f"{here}: a {_block_type(block)} block belongs to a user message", param=here)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _block_type(block: Any) -> str:
    return str(type(block).__struct_config__.tag)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation (``system`` and ``messages``) as chat messages."""
    if not req.messages:
        raise InvalidRequestError("messages: at least one message is required", param="messages")
    out = conversation_messages(req)
    if req.messages[-1].role == "assistant":
        raise InvalidRequestError(
            "messages: the last message is from the assistant; continuing a prefilled assistant turn is not "
            "supported here, end the conversation with a user message",
            param=f"messages[{len(req.messages) - 1}]",
        )
    return out


def conversation_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages, whatever the last turn (a prefix of a
    conversation, cut at a ``cache_control`` mark, may end anywhere)."""
    out: list[dict[str, Any]] = []
    system = req.system
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif system:
        out.append({"role": "system", "content": "\n".join(block.text for block in system)})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        content = message.content
        if message.role == "user":
            out.extend([{"role": "user", "content": content}] if isinstance(content, str) else _user_messages(content, where))
        else:
            out.append({"role": "assistant", "content": content} if isinstance(content, str) else _assistant_message(content, where))
    return out


def tool_cache_control(tool: dict[str, Any], i: int) -> CacheControl | None:
    """A custom tool's ``cache_control`` (tools stay plain objects in the schema, so it is checked
    here); a malformed one is a 400 naming it."""
    raw = tool.get("cache_control")
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, CacheControl)
    except msgspec.ValidationError as exc:
        where = f"tools[{i}].cache_control"
        raise InvalidRequestError(f"invalid parameter {where}: {exc}", param=where) from None


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Custom tools (``name``, ``description``, ``input_schema``) as chat function tools; server
    tools are refused by type."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind not in CUSTOM_TOOL_TYPES:
            raise InvalidRequestError(
                f"{where}: tools of type {kind!r} run on Anthropic's servers and are not available here; "
                "only custom tools (name, description, input_schema)",
                param=where,
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name: a tool needs a name", param=f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{where}.input_schema: a tool needs a JSON schema object", param=f"{where}.input_schema")
        tool_cache_control(tool, i)
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(req: CountTokensRequest) -> tuple[Any, bool | None]:
    """(chat ``tool_choice``, ``parallel_tool_calls``) for the request's ``tool_choice``."""
    choice = req.tool_choice
    if choice is None:
        return None, None
    if isinstance(choice, ToolChoiceNone):
        return "none", None
    parallel = False if choice.disable_parallel_tool_use else None
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return "auto", parallel


def template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    """Template variables for ``thinking`` and ``output_config.effort`` (templates that know them
    use them: ``enable_thinking`` for Qwen3-style templates, ``reasoning_effort`` for gpt-oss)."""
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = not isinstance(req.thinking, ThinkingDisabled)
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    return kwargs or None


def _response_format(req: CountTokensRequest) -> ResponseFormat | None:
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema))


def _refuse_unsupported(req: CountTokensRequest) -> None:
    if req.mcp_servers:
        raise InvalidRequestError("mcp_servers: MCP connectors are not available here", param="mcp_servers")
    if req.context_management is not None:
        raise InvalidRequestError(
            "context_management: context editing is not available here; send the context to use", param="context_management"
        )
    if isinstance(req, MessagesRequest):
        if req.container is not None:
            raise InvalidRequestError("container: code execution containers are not available here", param="container")
        stops = req.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(
                f"stop_sequences: at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", param="stop_sequences"
            )
        thinking = req.thinking
        budget = getattr(thinking, "budget_tokens", None)
        if budget is not None and budget >= req.max_tokens:
            raise InvalidRequestError(
                f"thinking.budget_tokens: {budget} must be less than max_tokens ({req.max_tokens}); thinking tokens "
                "count toward max_tokens",
                param="thinking.budget_tokens",
            )


def to_chat_request(req: CountTokensRequest) -> AnthropicChatRequest:
    """The chat request for ``req`` (a count_tokens request gives the same prompt, no settings)."""
    _refuse_unsupported(req)
    tool_choice, parallel = chat_tool_choice(req)
    chat = AnthropicChatRequest(
        model=req.model,
        messages=chat_messages(req),
        tools=chat_tools(req.tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs(req),
        response_format=_response_format(req),
        anthropic=req,
    )
    if isinstance(req, MessagesRequest):
        chat.max_tokens = req.max_tokens
        chat.stream = bool(req.stream)
        chat.stop = [s for s in req.stop_sequences or [] if s] or None
        chat.temperature = req.temperature
        chat.top_p = req.top_p
        chat.top_k = req.top_k or None  # 0: no top-k cut
        chat.user = req.metadata.user_id if req.metadata is not None else None
        chat.nvext = req.nvext
    return chat
