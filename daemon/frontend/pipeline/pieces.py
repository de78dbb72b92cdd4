"""Generated text cut into pieces of three kinds, whatever the API surface that formats them.

The pipeline yields text deltas. An ``OutputSplitter`` cuts them into answer text
(``TextPiece``), reasoning (``ReasoningPiece``) and tool calls (``ToolCallPiece``: an id and a name
first, then the arguments in pieces). ``ParserSplitter`` reads them from the request's
``OutputParser`` (the reasoning and tool-call parsers of this package, chosen by the model card and
the request's tools); ``TextOnlySplitter`` is the splitter when no parser applies: every delta is
answer text, at no cost beyond a list. The Responses API makes output items of the pieces, the
Anthropic Messages API content blocks; ``streamed_pieces`` and ``all_pieces`` are how both writers
read a generation through a splitter (``ResponseWriter.stream`` and ``collect`` in serve.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from dynamod.daemon.frontend.parsers.base import ParsedDelta
from dynamod.daemon.frontend.parsers.output import OutputParser
from dynamod.daemon.frontend.pipeline.generation import Delta, TextGeneration


@dataclass(slots=True)
class TextPiece:
    text: str


@dataclass(slots=True)
class ReasoningPiece:
    text: str


@dataclass(slots=True)
class ToolCallPiece:
    """A piece of the ``index``-th function call: ``call_id`` and ``name`` on its first piece
    (a missing ``call_id`` gets one made up), then ``arguments`` text in pieces."""

    index: int
    arguments: str = ""
    name: str | None = None
    call_id: str | None = None


Piece = TextPiece | ReasoningPiece | ToolCallPiece


class OutputSplitter(Protocol):
    """Cuts generated text into pieces; ``finish`` returns what it still held back at the end."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class TextOnlySplitter:
    """No reasoning or tool-call parsing: all generated text is the answer."""

    def feed(self, text: str) -> list[Piece]:
        return [TextPiece(text)] if text else []

    def finish(self) -> list[Piece]:
        return []


class ParserSplitter:
    """The pieces of a chat ``OutputParser``'s deltas: reasoning, then content, then call pieces."""

    def __init__(self, parser: OutputParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> list[Piece]:
        return parsed_pieces(self._parser.feed(text))

    def finish(self) -> list[Piece]:
        return parsed_pieces(self._parser.finish())


def parsed_pieces(delta: ParsedDelta) -> list[Piece]:
    out: list[Piece] = []
    if delta.reasoning:
        out.append(ReasoningPiece(delta.reasoning))
    if delta.content:
        out.append(TextPiece(delta.content))
    for call in delta.tool_calls:
        out.append(ToolCallPiece(call.index, arguments=call.arguments, name=call.name, call_id=call.id))
    return out


def output_splitter(parser: OutputParser | None) -> OutputSplitter:
    """The splitter for a request whose chat plan built ``parser`` (None: nothing to parse)."""
    return TextOnlySplitter() if parser is None else ParserSplitter(parser)


async def streamed_pieces(
    gen: TextGeneration, first: Delta, splitter: OutputSplitter
) -> AsyncIterator[tuple[list[Piece], Delta]]:
    """(pieces, delta) for ``first`` and each later delta of ``gen``; the last delta's pieces end
    with what the splitter held back. A stream sends each delta's pieces before the next is
    awaited; the inter-token latency between deltas is observed here."""
    itl = gen.metrics.itl
    last = time.perf_counter()
    delta = first
    while True:
        pieces = splitter.feed(delta.text)
        if delta.finish_reason is not None:
            yield pieces + splitter.finish(), delta
            return
        yield pieces, delta
        delta = await gen.__anext__()
        now = time.perf_counter()
        itl.observe(now - last)
        last = now


async def all_pieces(gen: TextGeneration, first: Delta, splitter: OutputSplitter) -> tuple[list[Piece], Delta]:
    """Every piece of the generation from ``first`` on, and its last delta (unary responses)."""
    pieces = splitter.feed(first.text)
    delta = first
    while delta.finish_reason is None:
        delta = await gen.__anext__()
        pieces += splitter.feed(delta.text)
    return pieces + splitter.finish(), delta
