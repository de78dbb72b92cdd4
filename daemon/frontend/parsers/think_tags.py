"""Reasoning between ``<think>`` and ``</think>`` (DeepSeek-R1, Qwen3, QwQ, and most open
reasoning models).

Two variants differ only in where the reasoning may start:

- ``basic`` / ``qwen3``: reasoning only when the reply opens with ``<think>`` (leading whitespace
  allowed). A reply without it is all content: Qwen3 with ``enable_thinking: false`` writes none.
- ``deepseek_r1``: the reply starts inside the reasoning, with or without the opening tag (newer
  R1 chat templates put ``<think>`` into the prompt, so the model never writes it), and everything
  up to ``</think>`` is reasoning; a reply cut before the closing tag is all reasoning.

The whitespace the models write between ``</think>`` and the answer is not content.
"""

from __future__ import annotations

from dynamod.daemon.frontend.parsers.base import ReasoningParser, split_at_marker

THINK_START = "<think>"
THINK_END = "</think>"

_OPENING, _REASONING, _AFTER, _CONTENT = range(4)


class ThinkTagReasoningParser(ReasoningParser):
    markers = (THINK_START, THINK_END)

    def __init__(self, *, starts_in_reasoning: bool, start: str = THINK_START, end: str = THINK_END) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._start = start
        self._end = end
        self.markers = (start, end)
        self._state = _OPENING
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == _CONTENT:
            return "", text
        buf = self._buf + text
        reasoning = ""
        if self._state == _OPENING:
            stripped = buf.lstrip()
            if not stripped or (self._start.startswith(stripped) and stripped != self._start):
                self._buf = buf
                return "", ""
            if stripped.startswith(self._start):
                buf = stripped[len(self._start) :]
                self._state = _REASONING
            elif self._starts_in_reasoning:
                self._state = _REASONING
            else:
                self._buf = ""
                self._state = _CONTENT
                return "", buf
        if self._state == _REASONING:
            reasoning, buf, found = split_at_marker(buf, self._end)
            if not found:
                self._buf = buf
                return reasoning, ""
            self._state = _AFTER
        stripped = buf.lstrip()
        if not stripped:
            self._buf = ""
            return reasoning, ""
        self._buf = ""
        self._state = _CONTENT
        return reasoning, stripped

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == _REASONING or (self._state == _OPENING and self._starts_in_reasoning):
            return buf, ""
        if self._state == _OPENING:
            return "", buf
        return "", ""
