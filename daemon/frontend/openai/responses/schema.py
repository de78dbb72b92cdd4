"""The Responses API request (``POST /v1/responses``) and its translation into a chat request.

A Responses request is a chat request in other clothes: ``input`` (a string or a list of items)
and ``instructions`` become chat messages, flat function tools become chat tools, and
``max_output_tokens`` becomes ``max_completion_tokens``. ``to_chat_request`` builds a real
``ChatCompletionRequest`` (with every chat field at its default), so the chat pipeline (template,
tokenizer, sampling, routing, migration) serves it unchanged; the subclass ``ResponsesChatRequest``
carries the original request and this turn's messages along for the response object and the store.

``text.format`` (``json_object``, ``json_schema``) becomes chat's ``response_format``, so structured
outputs work as on chat. ``input_image`` parts become chat ``image_url`` parts (a vision-language
model takes them; a text model refuses them by name). What cannot be done here is refused with a
400 naming the parameter: hosted OpenAI tools (web search, file search, ...), files and audio in the
input, ``background``, ``conversation``, prompt templates, ``truncation: "auto"``, and logprobs.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from dynamod.daemon.frontend.openai.schema import (
    ChatCompletionRequest,
    JsonSchemaFormat,
    MaxTokens,
    NvExt,
    RequestBody,
    ResponseFormat,
    Temperature,
    TopP,
    decode_json_body,  # the chat bodies' decoding: 400 + param
)
from dynamod.daemon.frontend.preprocess.media.parts import WHERE_KEY
from dynamod.shared.errors import InvalidRequestError

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_FORMATS = ("text", "json_object", "json_schema")


class TextFormat(RequestBody, kw_only=True):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields flat (where
    chat nests them under ``response_format.json_schema``)."""

    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None

    def response_format(self) -> ResponseFormat | None:
        """The chat ``response_format`` for this format (None for plain text); the chat pipeline
        checks the schema and constrains decoding with it."""
        if self.type == "text":
            return None
        if self.type == "json_schema":
            schema = JsonSchemaFormat(name=self.name, description=self.description, schema=self.schema, strict=self.strict)
            return ResponseFormat(type="json_schema", json_schema=schema)
        return ResponseFormat(type=self.type)


class TextConfig(RequestBody, kw_only=True):
    format: TextFormat | None = None


class ReasoningConfig(RequestBody, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(RequestBody, kw_only=True):
    model: str
    # A string, or a list of input items (dicts; checked in ``input_messages``).
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # protocol.ACCEPTED_UNUSED
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Dynamo's extensions, as on chat requests.
    ignore_eos: bool | None = None
    nvext: NvExt | None = None

    def __post_init__(self) -> None:
        if self.store is None:
            self.store = True
        if self.stream is None:
            self.stream = False


class ResponsesChatRequest(ChatCompletionRequest, kw_only=True):
    """The chat request the pipeline serves, with what the Responses layer needs back."""

    responses: ResponsesRequest | None = None
    turn_messages: list[dict[str, Any]] = []  # this turn's input as messages (for the store)


_decoder = msgspec.json.Decoder(ResponsesRequest)


def decode_responses_request(body: bytes) -> ResponsesRequest:
    req: ResponsesRequest = decode_json_body(_decoder, body)
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise InvalidRequestError("background responses are not supported; leave 'background' unset", param="background")
    if req.conversation is not None:
        raise InvalidRequestError(
            "conversations are not kept by this server; chain turns with 'previous_response_id'", param="conversation"
        )
    if req.prompt is not None:
        raise InvalidRequestError("prompt templates are not supported; send 'input' and 'instructions'", param="prompt")
    if req.truncation == "auto":
        raise InvalidRequestError(
            "truncation 'auto' is not supported; an input over the context length is refused", param="truncation"
        )
    if req.top_logprobs or LOGPROBS_INCLUDE in (req.include or []):
        raise InvalidRequestError(
            "log probabilities are not returned by /v1/responses here; use /v1/chat/completions with 'logprobs'",
            param="include" if req.top_logprobs is None else "top_logprobs",
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type not in TEXT_FORMATS:
        raise InvalidRequestError(
            f"text.format.type must be one of {', '.join(TEXT_FORMATS)}, got {fmt.type!r}", param="text.format.type"
        )


# ------------------------------------------------------------------------------------------------
# Input items -> chat messages.


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or the text of its text parts joined by newlines
    (as vLLM joins them); other parts (images, files, audio) are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise InvalidRequestError(
                f"{where} has a content part of type {kind!r}; only text parts are supported by this model", param="input"
            )
    return "\n".join(texts)


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text (``_text_of``) or, when it has
    ``input_image`` parts, chat content parts in order, each image as chat's ``image_url`` part
    marked with its place here (``input[0].content[1]``), which an image error names. Whether the
    model takes images is the chat pipeline's to say (preprocess/media)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            if part.get("file_id") is not None:
                raise InvalidRequestError(f"{part_where}: file_id images are not supported here; send image_url", param="input")
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise InvalidRequestError(
                    f"{part_where}: input_image needs image_url (a data: URL or an http(s) URL)", param="input"
                )
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image, WHERE_KEY: part_where})
        else:
            parts.append({"type": "text", "text": _text_of([part], part_where)})
    return parts


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise InvalidRequestError(f"{where} (function_call) needs string call_id, name and arguments", param="input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """Chat messages for a Responses ``input``. Consecutive ``function_call`` items become one
    assistant message with several ``tool_calls``; ``reasoning`` items are dropped (chat templates
    drop earlier turns' reasoning too)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("'input' must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object (an input item)", param="input")
        kind = item.get("type")
        if kind in (None, "message"):
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise InvalidRequestError(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", param="input")
            # Chat templates know "system"; "developer" is the Responses API's name for it.
            content = _message_content(item.get("content"), where)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = _tool_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequestError(f"{where} (function_call_output) needs a string call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(
                f"{where} has type {kind!r}; supported input items are message, function_call, "
                "function_call_output and reasoning",
                param="input",
            )
    return messages


# ------------------------------------------------------------------------------------------------
# Tools.


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat tools; hosted tools are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(
                f"tools[{i}] has type {kind!r}: hosted OpenAI tools are not available here; only function tools",
                param="tools",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}] needs a function name", param="tools")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise InvalidRequestError(f"tool_choice must be auto, none, required or a function, got {choice!r}", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        f"tool_choice of type {choice.get('type')!r} is not supported; use auto, none, required or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


# ------------------------------------------------------------------------------------------------
# The chat request.


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ResponsesChatRequest:
    """The chat request for ``req`` after ``history`` (the earlier turns' messages, from the
    store). ``instructions`` lead the conversation as a system message and belong to this turn
    only: earlier turns' instructions are not carried over (as OpenAI does)."""
    turn = input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + turn
    template_kwargs = None
    if req.reasoning is not None and req.reasoning.effort is not None:
        template_kwargs = {"reasoning_effort": req.reasoning.effort}  # templates that know it (gpt-oss) use it
    return ResponsesChatRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=bool(req.stream),
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=req.text.format.response_format() if req.text is not None and req.text.format is not None else None,
        chat_template_kwargs=template_kwargs,
        ignore_eos=bool(req.ignore_eos),
        nvext=req.nvext,
        user=req.user,
        responses=req,
        turn_messages=turn,
    )
