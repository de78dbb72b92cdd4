"""What every output parser shares: the delta it produces, the tool-call bookkeeping, the two
parser interfaces and the held-back-marker rule.

A model writes tool calls and reasoning as markup inside its text (``<tool_call>{...}</tool_call>``,
``<think>...</think>``). The parsers turn that text, fed in arbitrary pieces, into OpenAI's three
channels: ``content``, ``reasoning_content`` and ``tool_calls``. Text that might be the start of a
marker is held back until the next piece decides it, so no markup ever leaks into ``content``
whatever the chunk boundaries; the concatenation of everything emitted does not depend on them.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call, as OpenAI streams it: the first piece of a call carries its
    ``id`` and ``name``; every piece may carry the next part of the JSON ``arguments`` string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    """A whole tool call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of model text turned into; any part may be empty."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallTracker:
    """Numbers the calls of one response, gives them ids, and buffers their deltas until taken.

    ``allowed`` (the request's tool names, or the one named by ``tool_choice``) decides whether a
    parsed name is a call at all: a name the client never offered is the model talking, and its
    text stays content. ``max_calls`` is 1 when the client set ``parallel_tool_calls: false``:
    further calls are parsed (so their markup does not leak) and dropped.

    A call is announced as soon as its name is known, so its arguments can stream; one that turns
    out malformed at its end is retracted (its text becomes content) unless part of it has
    already been sent, which cannot be taken back: then it keeps the arguments it got.
    """

    def __init__(self, allowed: Collection[str] | None = None, max_calls: int | None = None) -> None:
        self._allowed = frozenset(allowed) if allowed is not None else None
        self._max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._pending: list[ToolCallDelta] = []
        self._sent = 0  # calls whose first delta has been taken (sent to the client)

    def accepts(self, name: str) -> bool:
        return bool(name) and (self._allowed is None or name in self._allowed)

    def begin(self, name: str) -> int | None:
        """Opens a call; returns its index, or None when the call is over ``max_calls`` (dropped)."""
        if self._max_calls is not None and len(self.calls) >= self._max_calls:
            return None
        index = len(self.calls)
        call = ToolCall(id=new_call_id(), name=name, arguments="")
        self.calls.append(call)
        self._pending.append(ToolCallDelta(index=index, id=call.id, name=name))
        return index

    def add_arguments(self, index: int, piece: str) -> None:
        if not piece:
            return
        self.calls[index].arguments += piece
        last = self._pending[-1] if self._pending else None
        if last is not None and last.index == index:
            last.arguments += piece
        else:
            self._pending.append(ToolCallDelta(index=index, arguments=piece))

    def retract(self, index: int) -> bool:
        """Takes back the last call, found malformed at its end, if none of it has been sent yet
        (always so for a unary response, which is parsed in one pass); False if it is out."""
        if index != len(self.calls) - 1 or index < self._sent:
            return False
        self.calls.pop()
        self._pending = [d for d in self._pending if d.index != index]
        return True

    def take(self) -> list[ToolCallDelta]:
        """The deltas since the last call (merged per call), and forgets them."""
        if not self._pending:
            return []
        out, self._pending = self._pending, []
        self._sent = len(self.calls)
        return out


class ToolCallParser(ABC):
    """One model family's tool-call syntax. ``feed`` returns the content text (markup removed) and
    reports calls to the tracker; ``finish`` flushes what was held back at the end of the output.

    ``markers`` are texts that are special tokens in that family's tokenizers: the detokenizer
    keeps them in the text (it drops special tokens otherwise), or the parser would never see them.
    """

    markers: Sequence[str] = ()
    # The finish reason of an output that stopped after calling: OpenAI says ``tool_calls``,
    # except when the request named the function it must call (then ``stop``).
    finish_reason_for_calls: str = "tool_calls"

    def __init__(self, calls: ToolCallTracker) -> None:
        self.calls = calls

    @abstractmethod
    def feed(self, text: str) -> str:
        """Consumes a piece of model text; returns the content it releases."""

    @abstractmethod
    def finish(self) -> str:
        """The end of the output: returns held content (a malformed call comes back as text)."""


class ReasoningParser(ABC):
    """One model family's reasoning syntax: splits text into (reasoning, content)."""

    markers: Sequence[str] = ()

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """Consumes a piece of model text; returns the (reasoning, content) it releases."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """The end of the output: returns whatever was held back."""


class BetweenCalls:
    """Content around tool calls in families that mark each call: whitespace after a call is held
    back (a newline between two calls is not an answer), and released with the text it precedes
    when real content follows."""

    __slots__ = ("after_call", "held")

    def __init__(self) -> None:
        self.after_call = False
        self.held = ""

    def call_ended(self) -> None:
        self.after_call = True
        self.held = ""

    def content(self, text: str) -> str:
        if not self.after_call or not text:
            return text
        if text.isspace():
            self.held += text
            return ""
        text, self.held = self.held + text, ""
        return text


class MarkedCallsParser(ToolCallParser):
    """A family that marks each call (Hermes' tags, Mistral's ``[TOOL_CALLS]``): text between
    calls goes through ``BetweenCalls`` (``_content``), and ``_buf`` holds the end of the text
    seen so far that may begin a marker."""

    def __init__(self, calls: ToolCallTracker) -> None:
        super().__init__(calls)
        self._buf = ""
        self._between = BetweenCalls()
        self._content = self._between.content


def split_at_marker(buf: str, marker: str) -> tuple[str, str, bool]:
    """``(before, rest, True)`` when ``buf`` holds ``marker``: the text before it and the text
    after it. Otherwise ``(text, held, False)``: ``held`` is the end of ``buf`` that may begin the
    marker (it waits for the next piece), ``text`` everything before it."""
    i = buf.find(marker)
    if i < 0:
        cut = len(buf) - held_marker_len(buf, (marker,))
        return buf[:cut], buf[cut:], False
    return buf[:i], buf[i + len(marker) :], True


def held_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``:
    that many characters must wait for the next piece before they can be called plain text."""
    best = 0
    n = len(text)
    for marker in markers:
        first = marker[0]
        longest = min(len(marker) - 1, n)
        if longest <= best:
            continue
        # Cheap reject: the marker's first character must occur in the tail at all.
        at = text.find(first, n - longest)
        while at != -1:
            k = n - at
            if k > best and marker.startswith(text[at:]):
                best = k
                break
            at = text.find(first, at + 1)
    return best
