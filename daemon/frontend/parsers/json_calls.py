"""Tool calls written as JSON, read incrementally: the shared core of the Hermes, Llama 3 JSON and
Mistral parsers.

A call object ``{"name": "f", "arguments": {...}}`` arrives a few characters at a time. OpenAI
streams a call as its id and name first and then the arguments in pieces, so the scanner walks
the object's top-level members as the text grows (strings and nesting aware, never re-reading what
it has passed: a long argument costs linear time) and the arguments' raw text is forwarded as it
arrives. The concatenated pieces are exactly the arguments as the model wrote them.

A call is announced only once its name is complete and is one the client offered: text that only
looks like a call (a JSON answer, a made-up function) goes back to the content instead. A call
whose arguments turn out malformed or cut off is retracted and given back as content too, unless
a piece of it has already been streamed (see ``ToolCallTracker.retract``).
"""

from __future__ import annotations

import json
import re

from dynamod.daemon.frontend.parsers.base import ToolCallTracker

_IN_STRING = re.compile(r'["\\]')
_IN_CONTAINER = re.compile(r'["\[\]{}]')
_WS = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"

NAME_KEY = "name"
ARGUMENTS_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"


class ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces. Only the structure is
    followed (strings, escapes, nesting); the value itself is validated by whoever decodes it."""

    __slots__ = ("kind", "depth", "in_string", "done")

    def __init__(self) -> None:
        self.kind = ""  # "container", "string" or "scalar" once the first character is seen
        self.depth = 0
        self.in_string = False
        self.done = False

    def scan(self, buf: str, pos: int) -> int:
        """Scans ``buf`` from ``pos`` (the value's first character on the first call); returns the
        position reached. Once ``done``, the position is just past the value."""
        n = len(buf)
        if not self.kind:
            if pos >= n:
                return pos
            c = buf[pos]
            if c in "{[":
                self.kind, self.depth = "container", 1
                pos += 1
            elif c == '"':
                self.kind, self.in_string = "string", True
                pos += 1
            else:
                self.kind = "scalar"
        if self.kind == "scalar":
            while pos < n and buf[pos] not in _SCALAR_END:
                pos += 1
            self.done = pos < n
            return pos
        while pos < n:
            if self.in_string:
                m = _IN_STRING.search(buf, pos)
                if m is None:
                    return n
                if m.group() == "\\":
                    if m.end() >= n:
                        return m.start()  # the escaped character is not here yet
                    pos = m.end() + 1
                    continue
                self.in_string = False
                pos = m.end()
                if self.kind == "string":
                    self.done = True
                    return pos
                continue
            m = _IN_CONTAINER.search(buf, pos)
            if m is None:
                return n
            c = m.group()
            pos = m.end()
            if c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return pos
        return pos


# ObjectScanner states.
_OPEN, _KEY_OR_END, _KEY, _COLON, _VALUE_START, _VALUE, _COMMA_OR_END, _DONE, _ERROR = range(9)


class ObjectScanner:
    """Walks one JSON object's top-level members as its text grows: for each finished member the
    span of its raw value, and for the member being read its key and where its value starts."""

    __slots__ = ("state", "pos", "members", "key", "value_start", "_scanner", "_key_start")

    def __init__(self) -> None:
        self.state = _OPEN
        self.pos = 0
        self.members: dict[str, tuple[int, int]] = {}
        self.key: str | None = None  # the member being read
        self.value_start = 0
        self._scanner = ValueScanner()
        self._key_start = 0

    @property
    def done(self) -> bool:
        return self.state == _DONE

    @property
    def failed(self) -> bool:
        return self.state == _ERROR

    @property
    def in_value(self) -> bool:
        return self.state == _VALUE

    def scan(self, buf: str) -> None:
        n = len(buf)
        pos = self.pos
        while pos < n:
            st = self.state
            if st == _KEY or st == _VALUE:
                scanner = self._scanner
                pos = scanner.scan(buf, pos)
                if not scanner.done:
                    break
                if st == _KEY:
                    try:
                        key = json.loads(buf[self._key_start : pos])
                    except ValueError:
                        self.state = _ERROR
                        break
                    self.key = key
                    self.state = _COLON
                else:
                    assert self.key is not None
                    self.members[self.key] = (self.value_start, pos)
                    self.state = _COMMA_OR_END
                continue
            if st == _DONE or st == _ERROR:
                break
            c = buf[pos]
            if c in _WS:
                pos += 1
                continue
            if st == _OPEN:
                if c != "{":
                    self.state = _ERROR
                    break
                self.state = _KEY_OR_END
            elif st == _KEY_OR_END:
                if c == "}":
                    self.state = _DONE
                elif c == '"':
                    self._key_start = pos
                    self._scanner = ValueScanner()
                    self.state = _KEY
                    continue  # the scanner reads the opening quote
                else:
                    self.state = _ERROR
                    break
            elif st == _COLON:
                if c != ":":
                    self.state = _ERROR
                    break
                self.state = _VALUE_START
            elif st == _VALUE_START:
                self.value_start = pos
                self._scanner = ValueScanner()
                self.state = _VALUE
                continue
            elif st == _COMMA_OR_END:
                if c == ",":
                    self.state = _KEY_OR_END
                elif c == "}":
                    self.state = _DONE
                else:
                    self.state = _ERROR
                    break
            pos += 1
            if self.state == _DONE:
                break
        self.pos = pos


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _keep_or_retract(calls: ToolCallTracker, index: int | None, complete: bool) -> bool:
    """At a call's end: True if it stands (whole and valid, dropped over the limit, or already
    partly sent), False if it was taken back and its text is content."""
    if index is None:
        return True
    if complete and _is_json_object(calls.calls[index].arguments):
        return True
    return not calls.retract(index)


def _arguments_text(raw: str) -> str:
    """A finished arguments value as OpenAI's JSON string: a string value is JSON already
    encoded once more (some models write it so), null means no arguments."""
    if raw.startswith('"'):
        try:
            decoded = json.loads(raw)
        except ValueError:
            return raw
        return decoded if isinstance(decoded, str) else raw
    if raw == "null":
        return "{}"
    return raw


class JsonCallStreamer:
    """One call object arriving in pieces. ``feed`` returns None while the object is open, then
    the text after its end; ``close`` says whether it was a call (False: the caller gives its
    ``raw`` text back as content)."""

    def __init__(self, calls: ToolCallTracker) -> None:
        self._calls = calls
        self._scanner = ObjectScanner()
        self.raw = ""
        self.announced = False
        self._index: int | None = None
        self._name: str | None = None
        self._args_key: str | None = None
        self._args_sent = 0
        self.failed = False
        self.done = False

    def feed(self, piece: str) -> str | None:
        if self.failed:
            self.raw += piece
            return None
        self.raw += piece
        scanner = self._scanner
        scanner.scan(self.raw)
        if scanner.failed and not self.announced:
            self.failed = True
            return None
        self._report()
        if scanner.done or scanner.failed:
            # Announced and broken off: the call keeps what it got, what follows is not ours.
            if not self.announced:
                self.failed = True
                return None
            self.done = True
            rest = self.raw[scanner.pos :]
            self.raw = self.raw[: scanner.pos]
            return rest
        return None

    def _report(self) -> None:
        scanner = self._scanner
        members = scanner.members
        if not self.announced:
            if self._name is None and NAME_KEY in members:
                start, end = members[NAME_KEY]
                try:
                    name = json.loads(self.raw[start:end])
                except ValueError:
                    name = None
                if not isinstance(name, str) or not self._calls.accepts(name):
                    self.failed = True
                    return
                self._name = name
            if self._name is None:
                return
            self.announced = True
            self._index = self._calls.begin(self._name)
        if self._index is None:
            return  # over the parallel_tool_calls limit: parsed, not reported
        key = self._args_key
        if key is None:
            key = next((k for k in ARGUMENTS_KEYS if k in members), None)
            if key is None and scanner.in_value and scanner.key in ARGUMENTS_KEYS:
                key = scanner.key
            if key is None:
                return
            self._args_key = key
        if key in members:
            start, end = members[key]
            finished = True
        elif scanner.in_value and scanner.key == key:
            start, end = scanner.value_start, scanner.pos
            finished = False
        else:
            return
        if end <= start:
            return
        if self.raw[start] in "{[":
            self._calls.add_arguments(self._index, self.raw[start + self._args_sent : end])
            self._args_sent = end - start
        elif finished and self._args_sent == 0:
            self._calls.add_arguments(self._index, _arguments_text(self.raw[start:end]))
            self._args_sent = end - start

    def close(self) -> bool:
        """The output (or the call's wrapper) ended here."""
        if self.failed or not self.announced:
            return False
        complete = self._scanner.done or self.done
        if self._index is not None and self._args_sent == 0 and self._args_key is None and complete:
            self._calls.add_arguments(self._index, "{}")
        return _keep_or_retract(self._calls, self._index, complete)


class ArgumentsStreamer:
    """A call whose name came outside the JSON (Mistral's ``name[ARGS]{...}``): the text is the
    arguments value alone, forwarded as it arrives. ``feed``/``close`` as ``JsonCallStreamer``."""

    def __init__(self, calls: ToolCallTracker, name: str) -> None:
        self._calls = calls
        self._scanner = ValueScanner()
        self.raw = ""
        self._start = -1  # where the value begins in ``raw`` (-1: not yet)
        self._pos = 0  # how far the scanner has read
        self.announced = calls.accepts(name)
        self._index = calls.begin(name) if self.announced else None

    def feed(self, piece: str) -> str | None:
        self.raw += piece
        if not self.announced:
            return None
        if self._start < 0:
            stripped = self.raw.lstrip(_WS)
            if not stripped:
                return None
            self._start = self._pos = len(self.raw) - len(stripped)
        scanner = self._scanner
        before = self._pos
        self._pos = scanner.scan(self.raw, before)
        if self._index is not None and scanner.kind == "container":
            self._calls.add_arguments(self._index, self.raw[before : self._pos])
        if not scanner.done:
            return None
        if self._index is not None and scanner.kind != "container":
            self._calls.add_arguments(self._index, _arguments_text(self.raw[self._start : self._pos]))
        rest = self.raw[self._pos :]
        self.raw = self.raw[: self._pos]
        return rest

    def close(self) -> bool:
        if not self.announced:
            return False
        complete = self._scanner.done
        if self._index is not None:
            if self._start < 0:
                self._calls.add_arguments(self._index, "{}")
                complete = True
            elif not complete and self._scanner.kind == "scalar":
                self._calls.add_arguments(self._index, _arguments_text(self.raw[self._start :].rstrip(_WS)))
                complete = True
        return _keep_or_retract(self._calls, self._index, complete)
