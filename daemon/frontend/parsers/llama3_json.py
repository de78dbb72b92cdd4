"""Llama 3.x JSON tool calls: the whole reply is one or more call objects, optionally after the
``<|python_tag|>`` token, separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A reply that does not open with ``{`` (or the tag) is plain content from its first character on,
with nothing held back after that. One that opens like a call but is not one (a JSON answer
without a known ``name``) is given back as content.
"""

from __future__ import annotations

from dynamod.daemon.frontend.parsers.base import ToolCallParser, ToolCallTracker
from dynamod.daemon.frontend.parsers.json_calls import JsonCallStreamer

PYTHON_TAG = "<|python_tag|>"

_START, _CALL, _BETWEEN, _PLAIN = range(4)


class Llama3JsonToolParser(ToolCallParser):
    markers = (PYTHON_TAG,)

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._state = _START
        self._buf = ""
        self._raw = ""  # text since the last finished call, given back if the next one fails
        self._call: JsonCallStreamer | None = None

    def feed(self, text: str) -> str:
        if self._state == _PLAIN:
            return text
        buf = self._buf + text
        out = ""
        while buf:
            state = self._state
            if state == _START or state == _BETWEEN:
                stripped = buf.lstrip()
                if not stripped:
                    break
                if stripped.startswith(PYTHON_TAG):
                    self._raw += buf[: len(buf) - len(stripped) + len(PYTHON_TAG)]
                    buf = stripped[len(PYTHON_TAG) :]
                    continue
                if PYTHON_TAG.startswith(stripped):
                    break  # maybe the tag, cut
                if state == _BETWEEN and stripped[0] == ";":
                    self._raw += buf[: len(buf) - len(stripped) + 1]
                    buf = stripped[1:]
                    continue
                if stripped[0] == "{":
                    self._raw += buf[: len(buf) - len(stripped)]
                    buf = stripped
                    self._call = JsonCallStreamer(self.calls)
                    self._state = _CALL
                    continue
                # Not a call: everything from here (and what was held for a call) is content.
                out += self._give_back(buf)
                buf = ""
            else:
                call = self._call
                assert call is not None
                rest = call.feed(buf)
                buf = ""
                if call.failed:
                    out += self._give_back(call.raw)
                elif rest is not None:
                    if not call.close():  # malformed arguments: the call was taken back
                        out += self._give_back(call.raw + rest)
                        continue
                    self._call = None
                    self._raw = ""
                    self._state = _BETWEEN
                    buf = rest
        self._buf = buf
        return out

    def _give_back(self, text: str) -> str:
        out = (self._raw if not self.calls.calls else "") + text
        self._raw = ""
        self._call = None
        self._state = _PLAIN
        return out

    def finish(self) -> str:
        state, buf = self._state, self._buf
        self._buf = ""
        if state == _CALL:
            call = self._call
            assert call is not None
            if not call.close():
                return self._give_back(call.raw)
            return ""
        if state == _START:
            return self._raw + buf
        return ""
