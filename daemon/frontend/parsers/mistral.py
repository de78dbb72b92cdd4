"""Mistral tool calls, both generations of the format:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is Mistral 7B v0.3 / Mixtral / Nemo (tokenizer v3); the second Mistral Small 3.2 and
later (tokenizer v11+). ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens there, so the
detokenizer is told to keep them. Text before the marker is content; a marker followed by
something that is not a call gives its text back as content.
"""

from __future__ import annotations

from dynamod.daemon.frontend.parsers.base import (
    MarkedCallsParser,
    ToolCallTracker,
    split_at_marker,
)
from dynamod.daemon.frontend.parsers.json_calls import ArgumentsStreamer, JsonCallStreamer

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
MAX_NAME_CHARS = 256  # a "name" longer than this before [ARGS] is not a function name

_CONTENT, _AFTER_MARK, _ARRAY, _OBJECT, _NAME, _ARGS = range(6)


class MistralToolParser(MarkedCallsParser):
    markers = (TOOL_CALLS, ARGS)

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._state = _CONTENT
        self._raw = ""  # text of the call being read, from its marker on: given back on failure
        self._call: JsonCallStreamer | ArgumentsStreamer | None = None

    def feed(self, text: str) -> str:
        buf = self._buf + text
        out: list[str] = []
        while buf:
            state = self._state
            if state == _CONTENT:
                before, buf, found = split_at_marker(buf, TOOL_CALLS)
                out.append(self._content(before))
                if not found:
                    break
                self._raw = TOOL_CALLS
                self._state = _AFTER_MARK
            elif state == _AFTER_MARK or state == _ARRAY:
                stripped = buf.lstrip()
                self._raw += buf[: len(buf) - len(stripped)]
                buf = stripped
                if not buf:
                    break
                c = buf[0]
                if state == _AFTER_MARK:
                    if c == "[":
                        self._raw += c
                        buf = buf[1:]
                        self._state = _ARRAY
                    else:
                        self._state = _NAME
                elif c == ",":
                    self._raw += c
                    buf = buf[1:]
                elif c == "]":
                    buf = buf[1:]
                    self._end_call_run()
                elif c == "{":
                    self._call = JsonCallStreamer(self.calls)
                    self._state = _OBJECT
                else:
                    out.append(self._fail(buf))
                    buf = ""
            elif state == _NAME:
                i = buf.find(ARGS)
                if i < 0:
                    if len(buf) > MAX_NAME_CHARS:
                        out.append(self._fail(buf))
                        buf = ""
                    break
                name = buf[:i].strip()
                self._raw += buf[: i + len(ARGS)]
                buf = buf[i + len(ARGS) :]
                self._call = ArgumentsStreamer(self.calls, name)
                if not self._call.announced:
                    out.append(self._fail(buf))
                    buf = ""
                else:
                    self._state = _ARGS
            else:
                call = self._call
                assert call is not None
                rest = call.feed(buf)
                buf = ""
                if isinstance(call, JsonCallStreamer) and call.failed:
                    out.append(self._fail(""))
                elif rest is not None:
                    if not call.close():  # malformed arguments: the call was taken back
                        out.append(self._fail(rest))
                        continue
                    self._call = None
                    buf = rest
                    if state == _OBJECT:
                        self._raw = ""
                        self._state = _ARRAY
                    else:
                        self._end_call_run()
        self._buf = buf
        return "".join(out)

    def finish(self) -> str:
        state, buf = self._state, self._buf
        self._buf = ""
        if state == _CONTENT:
            return self._content(buf)
        if state in (_OBJECT, _ARGS):
            call = self._call
            assert call is not None
            if call.close():
                return ""
            return self._fail("")
        if state == _ARRAY and not self._raw.strip(" ,\t\r\n"):
            return ""  # an array cut between calls: the calls it had stand
        return self._fail(buf)

    def _end_call_run(self) -> None:
        self._raw = ""
        self._call = None
        self._between.call_ended()
        self._state = _CONTENT

    def _fail(self, rest: str) -> str:
        """Not a call after all: its text, from the marker on, is content."""
        call = self._call
        text = self._raw + (call.raw if call is not None else "") + rest
        self._raw = ""
        self._call = None
        self._state = _CONTENT
        return self._content(text)

