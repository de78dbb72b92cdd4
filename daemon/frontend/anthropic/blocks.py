"""Generated pieces -> Anthropic content blocks, and for a stream Anthropic's event sequence::

    message_start, ping
    per block:  content_block_start (text | thinking | tool_use)
                content_block_delta... (text_delta | thinking_delta | input_json_delta)
                content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop
    on a failure after the start: error

The pieces come from the request's ``OutputSplitter`` (``pipeline/pieces.py``: the same reasoning
and tool-call parsers as chat and Responses). Blocks are sequential, as Anthropic's are: a new
block opens when the kind of piece changes (thinking, then text, then tool uses) or the next tool
call begins, and closes the one before. A unary request uses the same builder without encoding
events (``emit=False``) and reads ``message()`` at the end.
"""

from __future__ import annotations

import json
from typing import Any

from dynamod.daemon.frontend.anthropic.schema import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorBody,
    ErrorDetail,
    Event,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    Ping,
    StopInfo,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
    encoder,
)
from dynamod.daemon.frontend.openai.formatters import sse_safe
from dynamod.daemon.frontend.pipeline.pieces import Piece, ReasoningPiece, TextPiece, ToolCallPiece
from dynamod.shared.protocol.llm import FINISH_LENGTH

STOP_END_TURN = "end_turn"
STOP_MAX_TOKENS = "max_tokens"
STOP_SEQUENCE = "stop_sequence"
STOP_TOOL_USE = "tool_use"
TOOL_USE_ID_PREFIX = "toolu_"


def stop_reason(finish_reason: str | None, stop_sequence: str | None, tool_use: bool) -> str:
    """Anthropic's ``stop_reason`` for how the generation ended."""
    if finish_reason == FINISH_LENGTH:
        return STOP_MAX_TOKENS
    if stop_sequence is not None:
        return STOP_SEQUENCE
    return STOP_TOOL_USE if tool_use else STOP_END_TURN


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, pinned_tokens: int = 0) -> Usage:
    """Anthropic's split of the prompt: the part the worker's cache held is read, the part after
    it that this request pinned is written (created), the rest is input; the three add up."""
    cached = min(cached_tokens, prompt_tokens)
    created = min(pinned_tokens, prompt_tokens - cached)
    return Usage(
        input_tokens=prompt_tokens - cached - created, output_tokens=completion_tokens,
        cache_creation_input_tokens=created, cache_read_input_tokens=cached,
    )


def sse_event(event: Event) -> bytes:
    kind = type(event).__struct_config__.tag
    return b"event: " + str(kind).encode() + b"\ndata: " + sse_safe(encoder.encode(event)) + b"\n\n"


class _Block:
    __slots__ = ("index", "kind", "parts", "call_id", "name")

    def __init__(self, index: int, kind: str, call_id: str = "", name: str = "") -> None:
        self.index = index
        self.kind = kind
        self.parts: list[str] = []
        self.call_id = call_id
        self.name = name

    def start_shape(self) -> ContentBlock:
        if self.kind == "text":
            return TextBlock(text="")
        if self.kind == "thinking":
            return ThinkingBlock(thinking="")
        return ToolUseBlock(id=self.call_id, name=self.name, input={})

    def final_shape(self) -> ContentBlock:
        text = "".join(self.parts)
        if self.kind == "text":
            return TextBlock(text=text)
        if self.kind == "thinking":
            return ThinkingBlock(thinking=text)
        return ToolUseBlock(id=self.call_id, name=self.name, input=_tool_input(text))


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object; a call cut short by ``max_tokens`` (its JSON
    unfinished, the stop reason says so) or one that is not an object gives ``{}``."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id(call_id: str | None, index: int, message_id: str) -> str:
    if call_id:
        return call_id if call_id.startswith(TOOL_USE_ID_PREFIX) else TOOL_USE_ID_PREFIX + call_id.removeprefix("call_")
    return f"{TOOL_USE_ID_PREFIX}{message_id.removeprefix('msg_')}_{index}"


class MessageBuilder:
    """The content of one message; ``emit`` False builds the blocks only (unary requests).
    ``show_thinking`` False (``thinking.display: "omitted"``) keeps thinking blocks empty."""

    def __init__(self, message_id: str, model: str, *, emit: bool, show_thinking: bool = True) -> None:
        self.id = message_id
        self.model = model
        self._emit = emit
        self._show_thinking = show_thinking
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}

    @property
    def has_tool_use(self) -> bool:
        return bool(self._calls)

    def _event(self, out: list[bytes], event: Event) -> None:
        if self._emit:
            out.append(sse_event(event))

    # -- the stream's frame ---------------------------------------------------------------------

    def start(self, usage: Usage) -> bytes:
        """``message_start`` (an empty message with the input usage), then a ``ping``."""
        out: list[bytes] = []
        message = Message(id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None, usage=usage)
        self._event(out, MessageStart(message=message))
        self._event(out, Ping())
        return b"".join(out)

    def finish(self, reason: str, stop_sequence: str | None, usage: Usage) -> bytes:
        """Closes the open block; ``message_delta`` with the stop reason and usage, ``message_stop``."""
        out: list[bytes] = []
        self._close(out)
        self._event(out, MessageDelta(delta=StopInfo(stop_reason=reason, stop_sequence=stop_sequence), usage=usage))
        self._event(out, MessageStop())
        return b"".join(out)

    def fail(self, error_type: str, message: str, request_id: str | None = None) -> bytes:
        """The stream's ``error`` event (Anthropic's client raises it as an ``APIStatusError``)."""
        out: list[bytes] = []
        self._event(out, ErrorBody(error=ErrorDetail(type=error_type, message=message), request_id=request_id))
        return b"".join(out)

    def message(self, reason: str, stop_sequence: str | None, usage: Usage) -> Message:
        """The whole message (unary responses)."""
        return Message(
            id=self.id, model=self.model, content=[b.final_shape() for b in self.blocks], stop_reason=reason,
            stop_sequence=stop_sequence, usage=usage,
        )

    # -- blocks ------------------------------------------------------------------------------------

    def add(self, pieces: list[Piece]) -> bytes:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                self._add_text(out, "text", piece.text)
            elif isinstance(piece, ReasoningPiece):
                self._add_text(out, "thinking", piece.text)
            else:
                self._add_call(out, piece)
        return b"".join(out)

    def _open_block(self, out: list[bytes], block: _Block) -> None:
        self._close(out)
        self.blocks.append(block)
        self._open = block
        self._event(out, ContentBlockStart(index=block.index, content_block=block.start_shape()))

    def _close(self, out: list[bytes]) -> None:
        block = self._open
        if block is not None:
            self._open = None
            self._event(out, ContentBlockStop(index=block.index))

    def _add_text(self, out: list[bytes], kind: str, text: str) -> None:
        if not text:
            return
        block = self._open
        if block is None or block.kind != kind:
            block = _Block(len(self.blocks), kind)
            self._open_block(out, block)
        if kind == "thinking":
            if not self._show_thinking:
                return
            block.parts.append(text)
            self._event(out, ContentBlockDelta(index=block.index, delta=ThinkingDelta(thinking=text)))
        else:
            block.parts.append(text)
            self._event(out, ContentBlockDelta(index=block.index, delta=TextDelta(text=text)))

    def _add_call(self, out: list[bytes], piece: ToolCallPiece) -> None:
        block = self._calls.get(piece.index)
        if block is None:
            index = len(self.blocks)
            block = _Block(index, "tool_use", _tool_use_id(piece.call_id, index, self.id), piece.name or "")
            self._calls[piece.index] = block
            self._open_block(out, block)
        elif piece.name and not block.name:
            block.name = piece.name
        if not piece.arguments:
            return
        block.parts.append(piece.arguments)
        if block is self._open:
            self._event(out, ContentBlockDelta(index=block.index, delta=InputJsonDelta(partial_json=piece.arguments)))
        # else: a parser that went back to an earlier call; its block is closed, the input still
        # counts in the final message.
