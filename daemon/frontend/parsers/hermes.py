"""Hermes-style tool calls (NousResearch Hermes 2/3, Qwen 2.5, Qwen 3, and many fine-tunes):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; each tagged region holds one JSON call. A region that is not a
call (bad JSON, a name the client did not offer) is given back as content, tags and all.
"""

from __future__ import annotations

from dynamod.daemon.frontend.parsers.base import (
    MarkedCallsParser,
    ToolCallTracker,
    split_at_marker,
)
from dynamod.daemon.frontend.parsers.json_calls import JsonCallStreamer

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(MarkedCallsParser):
    markers = (START, END)

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._call: JsonCallStreamer | None = None
        self._call_ended = False  # the object closed; text up to the end tag is dropped

    def feed(self, text: str) -> str:
        buf = self._buf + text
        out: list[str] = []
        while buf:
            if self._call is None:
                before, buf, found = split_at_marker(buf, START)
                out.append(self._content(before))
                if not found:
                    break
                self._call = JsonCallStreamer(self.calls)
                self._call_ended = False
            else:
                before, buf, found = split_at_marker(buf, END)
                self._feed_call(before)
                if not found:
                    break
                out.append(self._close_call(closed=True))
        self._buf = buf
        return "".join(out)

    def finish(self) -> str:
        out = self._close_call(closed=False) if self._call is not None else self._content(self._buf)
        self._buf = ""
        return out

    def _feed_call(self, piece: str) -> None:
        assert self._call is not None
        if piece and not self._call_ended:
            self._call_ended = self._call.feed(piece) is not None

    def _close_call(self, *, closed: bool) -> str:
        call = self._call
        assert call is not None
        self._call = None
        if call.close():
            self._between.call_ended()
            return ""
        return self._content(START + call.raw + (END if closed else ""))

