"""Builds OpenAI response bodies and SSE chunks for chat and text completions.

One formatter per request. Each chunk is a plain struct encoded once with msgspec; the id,
``created`` and model strings are fixed per request, so building a chunk costs a few struct
allocations and one encode.

A chat formatter may carry the response's ``OutputParser`` (tool calls, reasoning): then each text
delta goes through it and the chunk carries ``content``, ``reasoning_content`` and ``tool_calls``
deltas, and the unary message the same fields. Without one (no parser configured, no tools) the
text goes straight into ``content``, as before.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dynamod.daemon.frontend.openai.schema import (
    ChatChoice,
    ChatChoiceTokens,
    ChatChunkChoice,
    ChatChunkChoiceTokens,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkWithUsage,
    ChatDelta,
    ChatFunctionCall,
    ChatFunctionDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatToolCall,
    ChatToolCallDelta,
    Completion,
    CompletionChoice,
    CompletionChoiceTokens,
    CompletionChunk,
    CompletionChunkWithUsage,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    encoder,
)
from dynamod.daemon.frontend.parsers import OutputParser, ParsedDelta, ToolCallDelta
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor

SSE_PREFIX = b"data: "
SSE_SUFFIX = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def generation_usage(gen: Any) -> UsageInfo:
    """``make_usage`` of one ``TextGeneration``, with the pinned tokens when it asked for a pin."""
    usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    engine = gen.request
    if engine.preprocessed.pin is not None:
        usage.prompt_tokens_details.created_cache_tokens = engine.pinned_tokens
    return usage


# Characters JSON allows raw inside strings that some line splitters treat as line breaks (JS
# ``String.split`` on line terminators, Python's ``str.splitlines``): written raw, one would cut an
# SSE ``data:`` line in two for such a client, and a model's output can contain any of them.
_LINE_BREAKERS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_safe(payload: bytes) -> bytes:
    """JSON bytes with U+2028, U+2029 and U+0085 escaped (still the same JSON value). In UTF-8
    these byte sequences can only be those characters, so a plain replace is exact."""
    if b"\xe2\x80" not in payload and b"\xc2\x85" not in payload:
        return payload
    for raw, escaped in _LINE_BREAKERS:
        payload = payload.replace(raw, escaped)
    return payload


def sse(obj: object) -> bytes:
    return SSE_PREFIX + sse_safe(encoder.encode(obj)) + SSE_SUFFIX


class LogprobCollector:
    """Turns engine log-probabilities into the chat or completions ``logprobs`` objects."""

    def __init__(self, pre: ModelPreprocessor) -> None:
        self._pre = pre
        self.chat: list[ChatTokenLogprob] = []
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.offsets: list[int] = []
        self.top: list[dict[str, float]] | None = None  # completions' top_logprobs, when the engine sent them
        self._offset = 0

    def add_chat(
        self, token_ids: list[int], log_probs: list[float] | None, top: list[Any] | None = None
    ) -> ChatLogprobs | None:
        """``top``: per token, the engine's [token id, logprob] alternatives (top_logprobs)."""
        if not log_probs:
            return None
        entries = []
        token_text = self._pre.token_text
        for i, (token_id, lp) in enumerate(zip(token_ids, log_probs, strict=False)):
            text = token_text(token_id)
            alternatives = []
            if top is not None and i < len(top):
                for alt_id, alt_lp in top[i]:
                    alt = token_text(alt_id)
                    alternatives.append(TopLogprob(token=alt, logprob=float(alt_lp), bytes=list(alt.encode())))
            entries.append(
                ChatTokenLogprob(token=text, logprob=float(lp), bytes=list(text.encode()), top_logprobs=alternatives)
            )
        self.chat.extend(entries)
        return ChatLogprobs(content=entries)

    def add_completion(
        self, token_ids: list[int], log_probs: list[float] | None, top: list[Any] | None = None
    ) -> CompletionLogprobs | None:
        if not log_probs:
            return None
        tokens, lps, offsets = [], [], []
        tops: list[dict[str, float]] | None = [] if top is not None else None
        token_text = self._pre.token_text
        for i, (token_id, lp) in enumerate(zip(token_ids, log_probs, strict=False)):
            text = token_text(token_id)
            tokens.append(text)
            lps.append(float(lp))
            offsets.append(self._offset)
            self._offset += len(text)
            if tops is not None:
                # Two ids may share a text (byte-level pieces); the likelier one keeps the key.
                alternatives: dict[str, float] = {}
                for alt_id, alt_lp in top[i] if i < len(top) else ():
                    alternatives.setdefault(token_text(alt_id), float(alt_lp))
                tops.append(alternatives)
        self.tokens.extend(tokens)
        self.token_logprobs.extend(lps)
        self.offsets.extend(offsets)
        if tops is not None:
            if self.top is None:
                self.top = []
            self.top.extend(tops)
        return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)

    def chat_total(self) -> ChatLogprobs | None:
        return ChatLogprobs(content=self.chat) if self.chat else None

    def completion_total(self) -> CompletionLogprobs | None:
        if not self.tokens:
            return None
        return CompletionLogprobs(
            tokens=self.tokens, token_logprobs=self.token_logprobs, top_logprobs=self.top, text_offset=self.offsets
        )


class _Formatter:
    """What both response formatters share: the response id, timestamps and usage options."""

    object_prefix = ""
    index = 0  # the choice this formatter writes; fanout.py sets it per choice of an n > 1 request

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        continuous_usage: bool,
        return_token_ids: bool = False,
    ) -> None:
        self.id = self.object_prefix + response_id
        self._token_ids = return_token_ids
        self.created = created
        self.model = model
        self._with_usage = include_usage or continuous_usage
        self._continuous = continuous_usage

    # The endpoint's stream chunk types: plain, and with the ``usage`` field stream_options asked for.
    _chunk_type: ClassVar[type[Any]]
    _chunk_with_usage_type: ClassVar[type[Any]]

    def _sse_chunk(self, choices: list[Any], usage: UsageInfo | None) -> bytes:
        """One stream chunk of ``choices``; ``usage`` rides along with continuous usage only."""
        if self._with_usage:
            return sse(
                self._chunk_with_usage_type(
                    id=self.id, created=self.created, model=self.model, choices=choices,
                    usage=usage if self._continuous else None,
                )
            )
        return sse(self._chunk_type(id=self.id, created=self.created, model=self.model, choices=choices))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return sse(self._chunk_with_usage_type(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))


def _tool_call_deltas(deltas: list[ToolCallDelta]) -> list[ChatToolCallDelta] | None:
    if not deltas:
        return None
    return [
        ChatToolCallDelta(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=ChatFunctionDelta(name=d.name, arguments=d.arguments if d.arguments or d.id is not None else None),
        )
        for d in deltas
    ]


def _parsed_chat_delta(parsed: ParsedDelta, role: str | None) -> ChatDelta:
    content = parsed.content or None
    reasoning = parsed.reasoning or None
    tool_calls = _tool_call_deltas(parsed.tool_calls)
    if role is not None and content is None and reasoning is None and tool_calls is None:
        content = ""  # the first chunk says who speaks, as OpenAI's does, even with nothing yet
    return ChatDelta(role=role, content=content, reasoning_content=reasoning, tool_calls=tool_calls)


class ChatFormatter(_Formatter):
    object_prefix = "chatcmpl-"
    _chunk_type = ChatCompletionChunk
    _chunk_with_usage_type = ChatCompletionChunkWithUsage

    def __init__(self, *args: Any, parser: OutputParser | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent_role = False
        self._parser = parser

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | None,
        usage: UsageInfo | None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        """One SSE chunk; with an output parser, b"" when the text is all held back (it may be
        markup) and the chunk has nothing else to carry."""
        parser = self._parser
        if parser is not None:
            if finish_reason is None:
                parsed = parser.feed(text)
            else:
                parsed = parser.finish(text)
                finish_reason = parser.finish_reason(finish_reason)
            role = None if self._sent_role else "assistant"
            if (
                role is None and finish_reason is None and not parsed and logprobs is None
                and not (self._token_ids and token_ids) and usage is None
            ):
                return b""
            self._sent_role = True
            delta = _parsed_chat_delta(parsed, role)
        elif self._sent_role:
            delta = ChatDelta(content=text)
        else:
            self._sent_role = True
            delta = ChatDelta(role="assistant", content=text)
        if self._token_ids:
            choice: ChatChunkChoice = ChatChunkChoiceTokens(
                index=self.index, delta=delta, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids or []
            )
        else:
            choice = ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return self._sse_chunk([choice], usage)

    def response(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | None,
        usage: UsageInfo,
        token_ids: list[int] | None = None,
    ) -> bytes:
        parser = self._parser
        if parser is None:
            message = ChatMessage(role="assistant", content=text)
        else:
            parsed = parser.finish(text)  # the whole text at once: the streaming code, one piece
            finish_reason = parser.finish_reason(finish_reason)
            calls = parser.tool_calls
            content: str | None = parsed.content
            if calls and not content.strip():
                content = None
            message = ChatMessage(
                role="assistant",
                content=content,
                reasoning_content=parsed.reasoning or None,
                tool_calls=[ChatToolCall(id=c.id, function=ChatFunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
                or None,
            )
        if self._token_ids:
            choice: ChatChoice = ChatChoiceTokens(
                index=self.index, message=message, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids or []
            )
        else:
            choice = ChatChoice(index=self.index, message=message, finish_reason=finish_reason, logprobs=logprobs)
        return encoder.encode(ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage))


class CompletionFormatter(_Formatter):
    object_prefix = "cmpl-"
    _chunk_type = CompletionChunk
    _chunk_with_usage_type = CompletionChunkWithUsage

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: CompletionLogprobs | None,
        usage: UsageInfo | None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        return self._sse_chunk([self._choice(text, finish_reason, logprobs, token_ids)], usage)

    def _choice(
        self, text: str, finish_reason: str | None, logprobs: CompletionLogprobs | None, token_ids: list[int] | None
    ) -> CompletionChoice:
        if self._token_ids:
            return CompletionChoiceTokens(
                index=self.index, text=text, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids or []
            )
        return CompletionChoice(index=self.index, text=text, finish_reason=finish_reason, logprobs=logprobs)

    def response(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: CompletionLogprobs | None,
        usage: UsageInfo,
        token_ids: list[int] | None = None,
    ) -> bytes:
        choice = self._choice(text, finish_reason, logprobs, token_ids)
        return encoder.encode(Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage))
