"""gpt-oss's harmony format, read as text: each message is a header naming its channel, then
``<|message|>``, the body, and ``<|end|>`` (``<|return|>`` / ``<|call|>`` at the very end):

    <|channel|>analysis<|message|>The user wants...<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

``analysis`` bodies are reasoning; ``final`` and ``commentary`` bodies are content. The harmony
markers are special tokens, which the detokenizer is told to keep. A reply that does not open with
a harmony header is all content. Tool calls addressed in a ``commentary`` header
(``to=functions.name``) are not turned into ``tool_calls`` by this parser: their body is content.
"""

from __future__ import annotations

import re

from dynamod.daemon.frontend.parsers.base import ReasoningParser, held_marker_len

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
START = "<|start|>"
END_MARKERS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (CHANNEL, MESSAGE, START, "<|constrain|>", *END_MARKERS)
REASONING_CHANNEL = "analysis"
MAX_HEADER_CHARS = 1024  # a "header" longer than this is not one: give the text back as content

_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_OPENING, _HEADER, _BODY, _CONTENT = range(4)


class GptOssReasoningParser(ReasoningParser):
    markers = MARKERS

    def __init__(self) -> None:
        self._state = _OPENING
        self._buf = ""
        self._to_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == _CONTENT:
            return "", text
        buf = self._buf + text
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            state = self._state
            if state == _OPENING:
                stripped = buf.lstrip()
                if not stripped or any(m.startswith(stripped) for m in (CHANNEL, START)):
                    break
                if stripped.startswith((CHANNEL, START)):
                    buf = stripped
                    self._state = _HEADER
                else:
                    self._state = _CONTENT
                    content.append(buf)
                    buf = ""
            elif state == _HEADER:
                i = buf.find(MESSAGE)
                if i < 0:
                    if len(buf) > MAX_HEADER_CHARS:
                        self._state = _CONTENT
                        content.append(buf)
                        buf = ""
                    break
                match = _CHANNEL_RE.search(buf, 0, i)
                self._to_reasoning = match is not None and match.group(1) == REASONING_CHANNEL
                buf = buf[i + len(MESSAGE) :]
                self._state = _BODY
            elif state == _BODY:
                ends = [(j, m) for m in END_MARKERS if (j := buf.find(m)) >= 0]
                if not ends:
                    keep = held_marker_len(buf, END_MARKERS)
                    (reasoning if self._to_reasoning else content).append(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                j, marker = min(ends)
                (reasoning if self._to_reasoning else content).append(buf[:j])
                buf = buf[j + len(marker) :]
                self._state = _HEADER
            else:
                content.append(buf)
                buf = ""
        self._buf = buf
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == _BODY:
            return (buf, "") if self._to_reasoning else ("", buf)
        if self._state == _OPENING:
            return "", buf
        return "", ""  # an unfinished header is markup
