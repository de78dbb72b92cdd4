"""``tool_choice`` ``required`` or a named function: the output *is* the tool call.

Parsing alone cannot force a call: a model may still answer in prose. So, as vLLM does, the
request's output is constrained by guided decoding (``sampling.py`` adds the schema built here)
and the constrained text is read back as calls:

- a named function: the output is one JSON object matching that function's ``parameters``; the
  whole text is the call's ``arguments``;
- ``required``: the output is a JSON array of ``{"name": <one of the tools>, "parameters": <that
  tool's schema>}`` objects (at least one; at most one when ``parallel_tool_calls`` is false);
  each element becomes a call.

Both parsers are ``ToolCallParser``s, so they slot into ``OutputParser`` and stream like the
model-family parsers: a call's id and name go out as soon as they are known, then its arguments as
the text arrives. The finish reason is OpenAI's: ``tool_calls`` for ``required``, ``stop`` for a
named function.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from dynamod.daemon.frontend.parsers.base import ToolCallParser, ToolCallTracker
from dynamod.daemon.frontend.parsers.output import OutputParser, ToolSettings
from dynamod.shared.errors import InvalidRequestError

FORCING_MODES = ("required", "named")
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def forces_call(settings: ToolSettings | None) -> bool:
    """True when ``tool_choice`` makes the reply a tool call (``required`` or a named function)."""
    return settings is not None and settings.mode in FORCING_MODES


# -- the schema the output is constrained to ------------------------------------------------------


def tool_parameters(tools: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Each tool's ``parameters`` schema by name (a tool without one takes any object). The tools'
    shape and names have been checked by ``ToolSettings.from_request``."""
    out: dict[str, dict[str, Any]] = {}
    for j, tool in enumerate(tools):
        function = tool["function"]
        params = function.get("parameters")
        if params is None or params == {}:
            params = _EMPTY_OBJECT
        elif not isinstance(params, Mapping):
            raise InvalidRequestError(
                f"tools[{j}].function.parameters must be a JSON schema object", param=f"tools[{j}].function.parameters"
            )
        out[function["name"]] = dict(params)
    return out


def forced_call_schema(settings: ToolSettings, tools: Sequence[Any]) -> dict[str, Any]:
    """The JSON schema the output must match for a ``required`` or named ``tool_choice``."""
    params = tool_parameters(tools)
    if settings.name is not None:
        return params[settings.name]
    # Each tool's $defs move to the top, where "#/$defs/..." references resolve from the root.
    defs: dict[str, Any] = {}
    variants = []
    for name, schema in params.items():
        schema = copy.copy(schema)
        own = schema.pop("$defs", None)
        if own is not None:
            if not isinstance(own, Mapping):
                raise InvalidRequestError(f"$defs of tool {name!r} must be an object", param="tools")
            for key, value in own.items():
                if key in defs and defs[key] != value:
                    raise InvalidRequestError(
                        f"tools define $defs {key!r} twice with different schemas; give them distinct names",
                        param="tools",
                    )
                defs[key] = value
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not settings.parallel:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


# -- reading the constrained output back as calls -------------------------------------------------


class NamedCallParser(ToolCallParser):
    """The whole output is the arguments object of the one function ``tool_choice`` names."""

    finish_reason_for_calls = "stop"

    def __init__(self, calls: ToolCallTracker, name: str) -> None:
        super().__init__(calls)
        self._name = name
        self._index: int | None = None

    def _open(self) -> int:
        if self._index is None:
            index = self.calls.begin(self._name)
            assert index is not None  # a fresh tracker: the first call always fits
            self._index = index
        return self._index

    def feed(self, text: str) -> str:
        self.calls.add_arguments(self._open(), text)
        return ""

    def finish(self) -> str:
        self._open()  # even an empty output is the call the client forced
        return ""


class CallArrayParser(ToolCallParser):
    """Reads ``[{"name": ..., "parameters": {...}}, ...]`` as it arrives: a call opens when its
    name is complete and its ``parameters`` text streams as its arguments.

    A character scanner tracks JSON strings and nesting (the text need not be complete, so a JSON
    parser cannot be used). Depth 1 is inside the array, depth 2 inside one element. Output that is
    no such array (an engine that ignored the constraint) yields no calls, and ``finish`` hands the
    whole text back as content rather than dropping it.
    """

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._raw: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._key: str | None = None  # the element key whose value comes next (after its colon)
        self._collect: list[str] | None = None  # a key or the name being read
        self._collecting_key = False
        self._in_params = False
        self._params_started = False
        self._name: str | None = None
        self._index: int | None = None
        self._args: list[str] = []  # arguments text not yet handed to the tracker

    def feed(self, text: str) -> str:
        self._raw.append(text)
        for c in text:
            self._step(c)
        self._flush_args()
        return ""

    def finish(self) -> str:
        self._flush_args()
        if not self.calls.calls:
            return "".join(self._raw)
        return ""

    def _step(self, c: str) -> None:
        if self._in_string:
            self._string_char(c)
            return
        if self._in_params and self._params_char(c):
            return
        depth = self._depth
        if c == '"':
            self._in_string = True
            if depth == 2 and self._key is None:
                self._collect, self._collecting_key = [], True
            elif depth == 2 and self._key == "name":
                self._collect, self._collecting_key = [], False
        elif c in "{[":
            self._depth += 1
            if self._depth == 2:
                self._begin_element()
        elif c in "}]":
            if depth == 2:
                self._end_element()
            self._depth -= 1
        elif depth == 2 and c == ":":
            if self._key == "parameters":
                self._in_params, self._params_started = True, False
        elif depth == 2 and c == ",":
            self._key = None

    def _string_char(self, c: str) -> None:
        if self._in_params:
            self._args.append(c)
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
            if self._collect is not None:
                self._string_done("".join(self._collect))
                self._collect = None
            return
        if self._collect is not None:
            self._collect.append(c)

    def _string_done(self, raw: str) -> None:
        if self._collecting_key:
            self._key = raw
            return
        try:
            name = json.loads(f'"{raw}"')
        except ValueError:
            return
        self._name = name
        if self.calls.accepts(name):
            self._index = self.calls.begin(name)

    def _params_char(self, c: str) -> bool:
        """One character of the ``parameters`` value; False when the value has ended before it
        (a scalar value, ended by ``,`` or ``}``): the caller reads it as structure."""
        if not self._params_started:
            if c.isspace():
                return True
            self._params_started = True
        elif self._depth == 2 and c in ",}":
            self._end_params()
            return False
        self._args.append(c)
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 2:
                self._end_params()
        return True

    def _end_params(self) -> None:
        self._in_params = False
        self._key = None
        self._flush_args()

    def _flush_args(self) -> None:
        # Arguments that arrive before the name (an engine that ignored property order) wait for it.
        if self._args and self._index is not None:
            self.calls.add_arguments(self._index, "".join(self._args))
            self._args = []

    def _begin_element(self) -> None:
        self._key = None
        self._name = None
        self._index = None
        self._args = []
        self._in_params = False

    def _end_element(self) -> None:
        self._flush_args()
        self._key = None
        self._index = None
        self._args = []


def forced_output_parser(settings: ToolSettings) -> OutputParser:
    """The output parser of a reply forced to be tool calls (``forces_call(settings)``). No
    reasoning parser: the constraint holds from the first token, so the reply has no reasoning,
    and a parser that starts in reasoning mode would take the calls for thoughts."""
    calls = ToolCallTracker(settings.allowed_names(), max_calls=None if settings.parallel else 1)
    tools: ToolCallParser
    if settings.name is not None:
        tools = NamedCallParser(calls, settings.name)
    else:
        tools = CallArrayParser(calls)
    return OutputParser(None, tools, calls)
