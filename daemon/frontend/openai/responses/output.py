"""Generated text -> Responses output items and streaming events.

The chat pipeline yields text deltas; an ``OutputSplitter`` (``pipeline/pieces.py``, shared with
the Anthropic surface) cuts them into pieces of three kinds, the same three a chat response
carries: answer text, reasoning and function calls. This module turns each kind into its output
item whatever produced it.

``ResponseBuilder`` keeps the output items and, for a stream, writes OpenAI's event sequence::

    response.created, response.in_progress
    per item:  response.output_item.added
               message:        response.content_part.added, response.output_text.delta..., response.output_text.done,
                               response.content_part.done
               reasoning:      response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                               response.content_part.done
               function_call:  response.function_call_arguments.delta..., response.function_call_arguments.done
               response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | error + response.failed

Every event carries a ``sequence_number`` counting from 0. A new item opens when the kind of piece
changes (reasoning, then the answer, then calls), and items are done in the order they opened.
A unary request uses the same builder without encoding events (``emit=False``).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Any

import msgspec

from dynamod.daemon.frontend.openai.formatters import sse_safe
from dynamod.daemon.frontend.pipeline.pieces import Piece, ReasoningPiece, TextPiece, ToolCallPiece

STATUS_IN_PROGRESS = "in_progress"
STATUS_COMPLETED = "completed"
STATUS_INCOMPLETE = "incomplete"
STATUS_FAILED = "failed"

_encoder = msgspec.json.Encoder()


def _short_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Item(ABC):
    """One output item being built; subclasses know their kind's events and final shape."""

    kind = ""

    def __init__(self, output_index: int, item_id: str) -> None:
        self.output_index = output_index
        self.id = item_id
        self.status = STATUS_IN_PROGRESS

    @abstractmethod
    def to_dict(self, *, with_content: bool = True) -> dict[str, Any]:
        """The item as the Responses API shows it (``with_content=False``: without its content)."""


class _MessageItem(_Item):
    kind = "message"

    def __init__(self, output_index: int) -> None:
        super().__init__(output_index, _short_id("msg"))
        self.text: list[str] = []

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def to_dict(self, *, with_content: bool = True) -> dict[str, Any]:
        content = [self.part("".join(self.text))] if with_content else []
        return {"id": self.id, "type": "message", "status": self.status, "role": "assistant", "content": content}


class _ReasoningItem(_Item):
    kind = "reasoning"

    def __init__(self, output_index: int) -> None:
        super().__init__(output_index, _short_id("rs"))
        self.text: list[str] = []

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text}

    def to_dict(self, *, with_content: bool = True) -> dict[str, Any]:
        content = [self.part("".join(self.text))] if with_content else []
        return {"id": self.id, "type": "reasoning", "status": self.status, "summary": [], "content": content}


class _FunctionCallItem(_Item):
    kind = "function_call"

    def __init__(self, output_index: int, call_id: str, name: str) -> None:
        super().__init__(output_index, _short_id("fc"))
        self.call_id = call_id
        self.name = name
        self.arguments: list[str] = []

    def to_dict(self, *, with_content: bool = True) -> dict[str, Any]:
        return {
            "id": self.id, "type": "function_call", "status": self.status, "call_id": self.call_id, "name": self.name,
            "arguments": "".join(self.arguments) if with_content else "",
        }


class ResponseBuilder:
    """The output of one response; ``emit`` False builds the items only (unary requests)."""

    def __init__(self, response_id: str, created_at: int, echo: dict[str, Any], *, emit: bool) -> None:
        self.id = response_id
        self.created_at = created_at
        self._echo = echo  # the request's settings the response object repeats
        self._emit = emit
        self._seq = 0
        self.items: list[_Item] = []
        self._open: list[_Item] = []  # opened and not done yet, in opening order
        self._calls: dict[int, _FunctionCallItem] = {}

    # -- events -----------------------------------------------------------------------------------

    def _event(self, out: list[bytes], kind: str, fields: dict[str, Any]) -> None:
        if not self._emit:
            return
        fields["type"] = kind
        fields["sequence_number"] = self._seq
        self._seq += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + sse_safe(_encoder.encode(fields)) + b"\n\n")

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        out: list[bytes] = []
        snapshot = self.response(STATUS_IN_PROGRESS)
        self._event(out, "response.created", {"response": snapshot})
        self._event(out, "response.in_progress", {"response": snapshot})
        return b"".join(out)

    def add(self, pieces: list[Piece]) -> bytes:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                self._add_text(out, piece.text)
            elif isinstance(piece, ReasoningPiece):
                self._add_reasoning(out, piece.text)
            else:
                self._add_call(out, piece)
        return b"".join(out)

    def finish(self, status: str, usage: dict[str, Any] | None, *, incomplete_reason: str | None = None) -> bytes:
        """Closes the open items and writes the final event (``response.completed`` or
        ``response.incomplete``)."""
        out: list[bytes] = []
        item_status = STATUS_INCOMPLETE if status == STATUS_INCOMPLETE else STATUS_COMPLETED
        for item in list(self._open):
            self._close(out, item, item_status)
        kind = "response.completed" if status == STATUS_COMPLETED else "response.incomplete"
        self._event(out, kind, {"response": self.response(status, usage, incomplete_reason=incomplete_reason)})
        return b"".join(out)

    def fail(self, code: str, message: str) -> bytes:
        """An ``error`` event, then ``response.failed`` with what was produced so far."""
        out: list[bytes] = []
        for item in list(self._open):
            item.status = STATUS_INCOMPLETE
            self._open.remove(item)
        self._event(out, "error", {"code": code, "message": message, "param": None})
        self._event(out, "response.failed", {"response": self.response(STATUS_FAILED, error={"code": code, "message": message})})
        return b"".join(out)

    # -- items ------------------------------------------------------------------------------------

    def _current(self, kind: str) -> _Item | None:
        last = self._open[-1] if self._open else None
        return last if last is not None and last.kind == kind else None

    def _open_item(self, out: list[bytes], item: _Item) -> None:
        # Items are sequential: a new one (another kind, or the next call) ends the one before.
        for other in list(self._open):
            self._close(out, other, STATUS_COMPLETED)
        self.items.append(item)
        self._open.append(item)
        self._event(out, "response.output_item.added", {"output_index": item.output_index, "item": item.to_dict(with_content=False)})
        if isinstance(item, _MessageItem):
            self._event(out, "response.content_part.added", self._where(item) | {"part": item.part("")})
        elif isinstance(item, _ReasoningItem):
            self._event(out, "response.content_part.added", self._where(item) | {"part": item.part("")})

    @staticmethod
    def _where(item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.output_index, "content_index": 0}

    def _add_text(self, out: list[bytes], text: str) -> None:
        if not text:
            return
        item = self._current("message")
        if item is None:
            item = _MessageItem(len(self.items))
            self._open_item(out, item)
        assert isinstance(item, _MessageItem)
        item.text.append(text)
        self._event(out, "response.output_text.delta", self._where(item) | {"delta": text, "logprobs": []})

    def _add_reasoning(self, out: list[bytes], text: str) -> None:
        if not text:
            return
        item = self._current("reasoning")
        if item is None:
            item = _ReasoningItem(len(self.items))
            self._open_item(out, item)
        assert isinstance(item, _ReasoningItem)
        item.text.append(text)
        self._event(out, "response.reasoning_text.delta", self._where(item) | {"delta": text})

    def _add_call(self, out: list[bytes], piece: ToolCallPiece) -> None:
        item = self._calls.get(piece.index)
        if item is None:
            item = _FunctionCallItem(len(self.items), piece.call_id or _short_id("call"), piece.name or "")
            self._calls[piece.index] = item
            self._open_item(out, item)
        elif piece.name and not item.name:
            item.name = piece.name
        if piece.arguments and item not in self._open:
            # A parser that went back to an earlier call: its item is done and its events sent;
            # the arguments still count in the final object (and in the store).
            item.arguments.append(piece.arguments)
            return
        if piece.arguments:
            item.arguments.append(piece.arguments)
            self._event(
                out, "response.function_call_arguments.delta",
                {"item_id": item.id, "output_index": item.output_index, "delta": piece.arguments},
            )

    def _close(self, out: list[bytes], item: _Item, status: str) -> None:
        self._open.remove(item)
        item.status = status
        if isinstance(item, _MessageItem):
            text = "".join(item.text)
            self._event(out, "response.output_text.done", self._where(item) | {"text": text, "logprobs": []})
            self._event(out, "response.content_part.done", self._where(item) | {"part": item.part(text)})
        elif isinstance(item, _ReasoningItem):
            text = "".join(item.text)
            self._event(out, "response.reasoning_text.done", self._where(item) | {"text": text})
            self._event(out, "response.content_part.done", self._where(item) | {"part": item.part(text)})
        elif isinstance(item, _FunctionCallItem):
            self._event(
                out, "response.function_call_arguments.done",
                {"item_id": item.id, "output_index": item.output_index, "name": item.name,
                 "arguments": "".join(item.arguments)},
            )
        self._event(out, "response.output_item.done", {"output_index": item.output_index, "item": item.to_dict()})

    # -- the response object --------------------------------------------------------------------

    def response(
        self,
        status: str,
        usage: dict[str, Any] | None = None,
        *,
        incomplete_reason: str | None = None,
        error: dict[str, Any] | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "output": [item.to_dict() for item in self.items] if status != STATUS_IN_PROGRESS else [],
            "usage": usage,
        }
        body.update(self._echo)
        if completed_at is not None:
            body["completed_at"] = completed_at
        return body

    def output_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages, for the next turn's history: one assistant message with
        the answer, the reasoning (``reasoning_content``) and the calls (``tool_calls``)."""
        text = "".join("".join(i.text) for i in self.items if isinstance(i, _MessageItem))
        reasoning = "".join("".join(i.text) for i in self.items if isinstance(i, _ReasoningItem))
        calls = [
            {"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": "".join(i.arguments)}}
            for i in self.items
            if isinstance(i, _FunctionCallItem)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return [message]


def make_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int = 0, pinned_tokens: int = 0
) -> dict[str, Any]:
    """``pinned_tokens``: written to the cache by ``nvext.cache_control`` (``cache_write_tokens``)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": pinned_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }
