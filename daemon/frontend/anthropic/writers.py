"""The two output formats of ``/v1/messages``: Anthropic's event stream, or one message body.

Both read the generation through the request's ``OutputSplitter`` (its chat plan's parser: text,
thinking, tool calls) into a ``MessageBuilder``. Failures before anything was sent are an
Anthropic-shaped error with its HTTP status (``refuse``); once the stream has begun, an ``error``
event ends it, which the official client raises as an ``APIStatusError``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dynamod.daemon.frontend.anthropic.blocks import MessageBuilder, make_usage, stop_reason
from dynamod.daemon.frontend.anthropic.convert import AnthropicChatRequest
from dynamod.daemon.frontend.anthropic.errors import (
    REQUEST_ID_PREFIX,
    describe,
    error_type,
    to_anthropic_error,
)
from dynamod.daemon.frontend.anthropic.schema import (
    MessagesRequest,
    ThinkingAdaptive,
    ThinkingEnabled,
    Usage,
    encoder,
)
from dynamod.daemon.frontend.http.asgi import SSE_HEADERS, send_error, send_json
from dynamod.daemon.frontend.pipeline.generation import Delta, TextGeneration
from dynamod.daemon.frontend.pipeline.request import FrontendRequest
from dynamod.daemon.frontend.pipeline.serve import ResponseWriter

logger = logging.getLogger(__name__)

MESSAGE_ID_PREFIX = "msg_"


def _shows_thinking(req: MessagesRequest) -> bool:
    thinking = req.thinking
    return not (isinstance(thinking, ThinkingEnabled | ThinkingAdaptive) and thinking.display == "omitted")


class MessagesWriter(ResponseWriter):
    """What both formats share: the builder, the splitter, the request id, the error shape."""

    def __init__(self, request: FrontendRequest[Any]) -> None:
        super().__init__(request)
        body = request.body
        assert isinstance(body, AnthropicChatRequest) and isinstance(body.anthropic, MessagesRequest)
        self.req: MessagesRequest = body.anthropic
        self.builder = MessageBuilder(
            MESSAGE_ID_PREFIX + request.request_id, self.req.model, emit=bool(self.req.stream),
            show_thinking=_shows_thinking(self.req),
        )

    @property
    def request_header(self) -> tuple[bytes, bytes]:
        return (b"request-id", (REQUEST_ID_PREFIX + self.request.request_id).encode())

    async def refuse(self, exc: BaseException, response_id: str | None = None) -> None:
        request = self.request
        request.watch.done()
        await send_error(request.send, to_anthropic_error(exc, request_id=request.request_id))

    def _end(self, gen: TextGeneration, finish_reason: str | None) -> tuple[str, str | None, Usage]:
        sequence = gen.stop_sequence
        reason = stop_reason(finish_reason, sequence, self.builder.has_tool_use)
        usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.request.pinned_tokens)
        return reason, sequence, usage


class MessageJsonWriter(MessagesWriter):
    """``stream`` false: one ``message`` object."""

    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        request = self.request
        builder = self.builder
        delta = await self.collect(gen, first, builder.add)
        if delta is None:
            return False
        message = builder.message(*self._end(gen, delta.finish_reason))
        request.watch.done()
        await send_json(request.send, 200, encoder.encode(message), [self.request_header, *request.route_headers(gen.request)])
        return True


class MessageEventWriter(MessagesWriter):
    """``stream`` true: Anthropic's event sequence (``blocks.py``)."""

    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        request = self.request
        builder = self.builder
        headers = [*SSE_HEADERS, self.request_header, *request.route_headers(gen.request)]
        await request.send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            opening = builder.start(make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
            body, delta = await self.stream(gen, first, opening, builder.add)
            body += builder.finish(*self._end(gen, delta.finish_reason))
            await self.end_stream(body)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band, then end the stream
            status, message, _ = describe(exc, request.request_id)
            logger.warning("message stream failed request_id=%s status=%d error=%s", builder.id, status, exc)
            await self.end_stream(builder.fail(error_type(status), message, REQUEST_ID_PREFIX + request.request_id))
            return False
