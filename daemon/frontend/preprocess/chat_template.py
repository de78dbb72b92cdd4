"""Renders OpenAI chat messages into a prompt with the model's jinja chat template.

Templates come from model directories, i.e. from third parties, so they run in jinja's immutable
sandbox with the same helpers HF ``apply_chat_template`` offers (``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII, ``{% generation %}`` blocks, loop controls):
a template that works with HF renders the same here.

Messages are validated and normalized first, the way vLLM does for text-only models: list
content of text parts is joined into one string, and tool-call arguments (a JSON string on the
wire) are parsed into objects, because templates write them with ``| tojson``. A problem with the
messages, found here or raised by the template, is an ``InvalidRequestError`` whose message says
which message is wrong.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.runtime import new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamod.daemon.frontend.preprocess.media.parts import WHERE_KEY
from dynamod.daemon.models import LocalModel
from dynamod.shared.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
# Content part types that carry text: "text" for everyone, "refusal" in assistant messages.
_TEXT_PART_FIELDS = {"text": "text", "refusal": "refusal"}
_IMAGE_PART = "image_url"  # OpenAI's image part (preprocess/media/parts.py reads the image itself)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters and non-ASCII, which changes the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None] | None = None) -> None:
        """``special_tokens`` maps template variable names (``bos_token``, ``eos_token``...) to text."""
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(
                f"the model's chat template does not compile: {exc} (line {exc.lineno})"
            ) from exc
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        # The template's globals (its own over the environment's, a ChainMap) flattened once:
        # ``Template.render`` walks that ChainMap twice per call, a quarter of rendering a
        # one-message chat.
        self._globals = dict(self._template.globals)

    @classmethod
    def from_model(cls, model: LocalModel) -> ChatTemplate | None:
        """The model's template with its bos/eos tokens; None when the model has no template."""
        if model.chat_template is None:
            return None
        return cls(
            model.chat_template,
            special_tokens={"bos_token": model.bos_token, "eos_token": model.eos_token},
        )

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: Mapping[str, Any] | None = None,
        images: bool = False,
    ) -> str:
        """The prompt text for ``messages``; ends with the assistant header when asked.
        ``images``: the model takes image parts (they reach the template as ``{"type": "image"}``)."""
        normalized = normalize_messages(messages, images=images)
        tool_list = _validate_tools(tools)
        context: dict[str, Any] = dict(template_kwargs or {})
        context.update(self._special_tokens)
        context.update(messages=normalized, add_generation_prompt=add_generation_prompt)
        if tool_list is not None:
            context["tools"] = tool_list
        try:
            return self._render(context)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        except Exception as exc:  # a template bug tripped by these messages: still the request's answer
            logger.info("chat_template_failed error=%s message=%s", type(exc).__name__, exc)
            raise InvalidRequestError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}", param="messages"
            ) from exc

    def _render(self, variables: dict[str, Any]) -> str:
        """``Template.render(**variables)`` with the globals already flattened: the same context
        (globals, then the variables over them), the same error handling."""
        template = self._template
        env = template.environment
        context = new_context(
            env, template.name, template.blocks, {**self._globals, **variables}, True, self._globals
        )
        try:
            return env.concat(template.root_render_func(context))  # type: ignore[attr-defined]
        except Exception:
            env.handle_exception()  # re-raises with the template's line numbers in the traceback
            raise  # not reached: keeps type checkers sure this returns a str


def normalize_messages(messages: Any, *, images: bool = False) -> list[dict[str, Any]]:
    """Validates OpenAI chat messages and returns them in the shape templates expect. With
    ``images`` (a vision-language model), a message with image parts keeps its content as a list
    of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts, as vLLM hands them to
    templates of the "openai" content format (HF's vision templates); the images themselves are
    the media loader's (preprocess/media)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidRequestError("'messages' must be a list of message objects", param="messages")
    if not messages:
        raise InvalidRequestError("'messages' must contain at least one message", param="messages")
    return [_normalize_message(i, message, images) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Any, images: bool = False) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(
            f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}", param=f"{where}.role"
        )
    out: dict[str, Any] = {"role": role}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise InvalidRequestError(f"{where}: only assistant messages may have tool_calls", param=where)
        out["tool_calls"] = _normalize_tool_calls(where, tool_calls)

    content = message.get("content")
    if content is None:
        if not (role == "assistant" and out.get("tool_calls")):
            raise InvalidRequestError(f"{where}.content is missing", param=f"{where}.content")
        out["content"] = None
    else:
        out["content"] = _content_text(where, role, content, images)

    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name")
        out["name"] = name
    if role == "tool":
        tool_call_id = message.get("tool_call_id")
        if tool_call_id is not None:
            if not isinstance(tool_call_id, str):
                raise InvalidRequestError(
                    f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id"
                )
            out["tool_call_id"] = tool_call_id
    return out


def _content_text(where: str, role: str, content: Any, images: bool = False) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if isinstance(content, bytes) or not isinstance(content, Sequence):
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of content parts", param=f"{where}.content"
        )
    texts: list[str] = []
    parts: list[dict[str, str]] = []  # with images: the parts in order
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{part_where} must be an object with a 'type'", param=part_where)
        part_type = part.get("type")
        part_where = part.get(WHERE_KEY) or part_where  # a part another API surface converted
        if images and part_type == _IMAGE_PART:
            parts.append({"type": "image"})
            continue
        field_name = _TEXT_PART_FIELDS.get(part_type) if isinstance(part_type, str) else None
        if part_type == _IMAGE_PART:
            raise InvalidRequestError(
                f"{part_where}: images are not supported: this model takes text parts only", param=part_where
            )
        if field_name is None or (part_type == "refusal" and role != "assistant"):
            raise InvalidRequestError(
                f"{part_where}.type {part_type!r} is not supported: this model takes text parts only",
                param=part_where,
            )
        text = part.get(field_name)
        if not isinstance(text, str):
            raise InvalidRequestError(f"{part_where}.{field_name} must be a string", param=part_where)
        texts.append(text)
        parts.append({"type": "text", "text": text})
    if len(parts) > len(texts):
        return parts
    # vLLM joins text parts with a newline for string-content templates; prompts then match.
    return "\n".join(texts)


def _normalize_tool_calls(where: str, tool_calls: Any) -> list[dict[str, Any]]:
    if isinstance(tool_calls, str | bytes) or not isinstance(tool_calls, Sequence):
        raise InvalidRequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(tool_calls):
        call_where = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(
                f"{call_where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                param=call_where,
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"{call_where}.function.arguments is not valid JSON: {exc}", param=call_where
                ) from exc
        if not isinstance(arguments, Mapping):
            raise InvalidRequestError(
                f"{call_where}.function.arguments must be a JSON object", param=call_where
            )
        normalized: dict[str, Any] = {
            "type": call.get("type", "function"),
            "function": {"name": function["name"], "arguments": dict(arguments)},
        }
        if isinstance(call.get("id"), str):
            normalized["id"] = call["id"]
        out.append(normalized)
    return out


def _validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise InvalidRequestError("'tools' must be a list of tool objects", param="tools")
    out: list[dict[str, Any]] = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"tools[{j}] must be an object", param=f"tools[{j}]")
        out.append(dict(tool))
    return out or None
