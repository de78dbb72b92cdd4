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
    BetweenCalls,
    ToolCallParser,
    ToolCallTracker,
    held_marker_len,
)
from dynamod.daemon.frontend.parsers.json_calls import JsonCallStreamer

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolCallParser):
    markers = (START, END)

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._buf = ""
        self._call: JsonCallStreamer | None = None
        self._call_ended = False  # the object closed; text up to the end tag is dropped
        self._between = BetweenCalls()
        self._content = self._between.content

    def feed(self, text: str) -> str:
        buf = self._buf + text
        out: list[str] = []
        while buf:
            if self._call is None:
                i = buf.find(START)
                if i < 0:
                    keep = held_marker_len(buf, (START,))
                    out.append(self._content(buf[: len(buf) - keep]))
                    buf = buf[len(buf) - keep :]
                    break
                out.append(self._content(buf[:i]))
                buf = buf[i + len(START) :]
                self._call = JsonCallStreamer(self.calls)
                self._call_ended = False
            else:
                j = buf.find(END)
                if j < 0:
                    keep = held_marker_len(buf, (END,))
                    self._feed_call(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                self._feed_call(buf[:j])
                buf = buf[j + len(END) :]
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

