"""Pythonic tool calls (Llama 3.2 / Llama 4 and other models prompted to write Python): the reply
is a Python list of calls with keyword arguments of literal values,

    [get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]

optionally wrapped in ``<|python_start|>`` / ``<|python_end|>``. Each call is read with ``ast``
(no evaluation: only literals are accepted) once the comma or bracket after it arrives, and sent
whole. A list that is not calls (``[1, 2, 3]``) is content.
"""

from __future__ import annotations

import ast
import json

from dynamod.daemon.frontend.parsers.base import ToolCallParser, ToolCallTracker

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"

_START, _LIST, _AFTER, _PLAIN = range(4)
_OPENERS = "([{"
_CLOSERS = ")]}"


def parse_call(source: str) -> tuple[str, str] | None:
    """``name(key=literal, ...)`` -> (name, JSON arguments), or None when it is not such a call."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted_name(node.func)
    if name is None:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return name, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):
        return None  # a literal JSON cannot carry (a set, bytes, a complex number)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class PythonicToolParser(ToolCallParser):
    markers = (PYTHON_START, PYTHON_END)

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._state = _START
        self._buf = ""
        self._prefix = ""  # what came before the list (whitespace, the start tag)
        self._pos = 0  # scan position in _buf (the list text)
        self._segment = 1  # where the current element starts in _buf
        self._depth = 0
        self._quote = ""
        self._escape = False

    def feed(self, text: str) -> str:
        if self._state == _PLAIN:
            return text
        self._buf += text
        if self._state == _START:
            stripped = self._buf.lstrip()
            if stripped.startswith(PYTHON_START):
                self._prefix += self._buf[: len(self._buf) - len(stripped) + len(PYTHON_START)]
                self._buf = stripped = stripped[len(PYTHON_START) :].lstrip()
            if not stripped or PYTHON_START.startswith(stripped):
                return ""
            if stripped[0] != "[":
                return self._give_back()
            self._prefix += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            self._state, self._pos, self._depth = _LIST, 1, 1
        if self._state == _LIST:
            return self._scan()
        return self._after()

    def _scan(self) -> str:
        buf = self._buf
        pos = self._pos
        n = len(buf)
        while pos < n:
            c = buf[pos]
            pos += 1
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote:
                    self._quote = ""
                continue
            if c in "\"'":
                self._quote = c
            elif c in _OPENERS:
                self._depth += 1
            elif c in _CLOSERS:
                self._depth -= 1
                if self._depth == 0:
                    if c != "]" or not self._element(buf[self._segment : pos - 1], last=True):
                        self._pos = pos
                        return self._give_back()
                    self._buf = buf[pos:]
                    self._state = _AFTER
                    return self._after()
            elif c == "," and self._depth == 1:
                if not self._element(buf[self._segment : pos - 1], last=False):
                    self._pos = pos
                    return self._give_back()
                self._segment = pos
        self._pos = pos
        return ""

    def _element(self, source: str, *, last: bool) -> bool:
        if last and not source.strip():
            return bool(self.calls.calls)  # "[]" is no call; a trailing comma is fine
        parsed = parse_call(source)
        if parsed is None or not self.calls.accepts(parsed[0]):
            return False
        index = self.calls.begin(parsed[0])
        if index is not None:
            self.calls.add_arguments(index, parsed[1])
        return True

    def _after(self) -> str:
        """After the list: the end tag and whitespace are markup; anything else is content."""
        stripped = self._buf.lstrip()
        if stripped.startswith(PYTHON_END):
            stripped = stripped[len(PYTHON_END) :].lstrip()
        if not stripped or PYTHON_END.startswith(stripped):
            self._buf = stripped
            return ""
        self._buf = ""
        self._state = _PLAIN
        return stripped

    def _give_back(self) -> str:
        """Not (or no longer) calls: the text from the first element not sent as a call on is content."""
        if self.calls.calls:
            out = self._buf[self._segment :].lstrip(", ") if self._state == _LIST else self._buf
        else:
            out = self._prefix + self._buf
        self._buf = self._prefix = ""
        self._state = _PLAIN
        return out

    def finish(self) -> str:
        if self._state == _START:
            out, self._buf = self._prefix + self._buf, ""
            return out
        if self._state == _LIST:
            return self._give_back()
        self._buf = ""
        return ""
