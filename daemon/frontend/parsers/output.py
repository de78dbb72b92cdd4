"""One response's output parser: the request's tool settings and the model's parsers combined.

Reasoning is split off first and tool calls are looked for in what is left, so a call the model
only thinks about is never made. Streaming feeds each text delta and sends what comes out;
a unary response feeds the whole text once: the same code, and the same result, since every
parser gives the same output whatever the pieces (the tests split recorded replies at every
boundary).

``build_output_parser`` returns None when there is nothing to parse (no parser configured, or no
tools and no reasoning parser): the frontend's hot path then costs nothing extra per chunk.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from dynamod.daemon.frontend.parsers.base import (
    ParsedDelta,
    ReasoningParser,
    ToolCall,
    ToolCallParser,
    ToolCallTracker,
)
from dynamod.daemon.frontend.parsers.registry import reasoning_parser, tool_call_parser
from dynamod.shared.errors import InvalidRequestError

FINISH_STOP = "stop"
FINISH_TOOL_CALLS = "tool_calls"
TOOL_CHOICE_MODES = ("none", "auto", "required")


class ToolSettings:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a request, checked: which names
    count as calls and how many. ``mode`` is none, auto, required or named (``name`` set)."""

    __slots__ = ("mode", "name", "names", "parallel")

    def __init__(self, mode: str, name: str | None, names: list[str], parallel: bool) -> None:
        self.mode = mode
        self.name = name
        self.names = names
        self.parallel = parallel

    @property
    def parses_calls(self) -> bool:
        return bool(self.names) and self.mode != "none"

    def allowed_names(self) -> list[str]:
        return [self.name] if self.name is not None else self.names

    @classmethod
    def from_request(cls, tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolSettings:
        names = tool_names(tools)
        mode, name = _tool_choice(tool_choice)
        if mode in ("required", "named") and not names:
            raise InvalidRequestError(
                f"tool_choice {tool_choice!r} needs 'tools'; pass the functions the model may call", param="tool_choice"
            )
        if name is not None and name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in 'tools' ({', '.join(names)})",
                param="tool_choice",
            )
        return cls(mode, name, names, parallel_tool_calls is not False)


def tool_names(tools: Sequence[Any] | None) -> list[str]:
    """The function names of ``tools`` (each ``{"type": "function", "function": {"name": ...}}``)."""
    if not tools:
        return []
    names = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                param=f"tools[{j}]",
            )
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{j}].type must be 'function'", param=f"tools[{j}].type")
        names.append(name)
    return names


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice in TOOL_CHOICE_MODES:
            return choice, None
    elif isinstance(choice, Mapping) and choice.get("type", "function") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str) and name:
            return "named", name
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


class OutputParser:
    """Feed text deltas, get ``ParsedDelta``s; ``finish`` at the end of the output."""

    __slots__ = ("_calls", "_reasoning", "_tools", "busy_ns", "ended_ns", "started_ns")

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, calls: ToolCallTracker | None
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._calls = calls
        # For the request's ``output_parse`` span: when parsing began and ended (Unix ns) and the
        # time spent inside the parser (ns), two clock reads per delta.
        self.started_ns = 0
        self.ended_ns = 0
        self.busy_ns = 0

    @property
    def names(self) -> tuple[str | None, str | None]:
        """(reasoning parser, tool-call parser) class names, for traces."""
        return (
            type(self._reasoning).__name__ if self._reasoning is not None else None,
            type(self._tools).__name__ if self._tools is not None else None,
        )

    @property
    def markers(self) -> tuple[str, ...]:
        """Marker texts the detokenizer must keep even where they are special tokens."""
        out: tuple[str, ...] = ()
        if self._reasoning is not None:
            out += tuple(self._reasoning.markers)
        if self._tools is not None:
            out += tuple(self._tools.markers)
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls found so far (whole ones once ``finish`` has run)."""
        return self._calls.calls if self._calls is not None else []

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if not self.started_ns:
            self.started_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
        else:
            reasoning, content = "", text
        out = self._tool_pass(reasoning, content, final=False)
        self.busy_ns += time.perf_counter_ns() - t0
        return out

    def finish(self, text: str = "") -> ParsedDelta:
        """The last piece of text, if any, and everything held back: call it once, at the end.
        (A unary response is one ``finish(whole_text)``.)"""
        if not self.started_ns:
            self.started_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        out = self._finish(text)
        self.busy_ns += time.perf_counter_ns() - t0
        self.ended_ns = time.time_ns()
        return out

    def _finish(self, text: str) -> ParsedDelta:
        reasoning_parser = self._reasoning
        if reasoning_parser is not None:
            reasoning, content = reasoning_parser.feed(text) if text else ("", "")
            more_reasoning, more_content = reasoning_parser.finish()
            reasoning += more_reasoning
            content += more_content
        else:
            reasoning, content = "", text
        return self._tool_pass(reasoning, content, final=True)

    def _tool_pass(self, reasoning: str, content: str, *, final: bool) -> ParsedDelta:
        tools = self._tools
        if tools is None:
            return ParsedDelta(content=content, reasoning=reasoning)
        assert self._calls is not None
        text = tools.feed(content) if content else ""
        if final:
            text += tools.finish()
        return ParsedDelta(content=text, reasoning=reasoning, tool_calls=self._calls.take())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI says ``tool_calls`` when the model stopped after calling (``stop`` when the
        request named the function: the parser says which); a reply cut by ``max_tokens`` stays
        ``length``."""
        if engine_reason == FINISH_STOP and self.tool_calls:
            return self._tools.finish_reason_for_calls if self._tools is not None else FINISH_TOOL_CALLS
        return engine_reason


def build_output_parser(
    *,
    tool_call_parser_name: str | None,
    reasoning_parser_name: str | None,
    tools: ToolSettings | None,
) -> OutputParser | None:
    """The parser for one response, or None when nothing in it needs parsing."""
    reasoning_factory = reasoning_parser(reasoning_parser_name)
    tool_cls = tool_call_parser(tool_call_parser_name) if tools is not None and tools.parses_calls else None
    if reasoning_factory is None and tool_cls is None:
        return None
    calls = None
    tool_parser = None
    if tool_cls is not None:
        assert tools is not None
        calls = ToolCallTracker(tools.allowed_names(), max_calls=None if tools.parallel else 1)
        tool_parser = tool_cls(calls)
    return OutputParser(reasoning_factory() if reasoning_factory is not None else None, tool_parser, calls)
