"""Builds OpenAI response bodies and SSE chunks for chat and text completions.

One formatter per request. Each chunk is a plain struct encoded once with msgspec; the id,
``created`` and model strings are fixed per request, so building a chunk costs a few struct
allocations and one encode.
"""

from __future__ import annotations

from typing import Any

from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.daemon.frontend.protocol import (
    ChatChoice,
    ChatChoiceTokens,
    ChatChunkChoice,
    ChatChunkChoiceTokens,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkWithUsage,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionChoiceTokens,
    CompletionChunk,
    CompletionChunkWithUsage,
    CompletionLogprobs,
    PromptTokensDetails,
    UsageInfo,
    encoder,
)

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


def sse(obj: object) -> bytes:
    return SSE_PREFIX + encoder.encode(obj) + SSE_SUFFIX


class LogprobCollector:
    """Turns engine log-probabilities into the chat or completions ``logprobs`` objects."""

    def __init__(self, pre: ModelPreprocessor) -> None:
        self._pre = pre
        self.chat: list[ChatTokenLogprob] = []
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.offsets: list[int] = []
        self._offset = 0

    def add_chat(self, token_ids: list[int], log_probs: list[float] | None) -> ChatLogprobs | None:
        if not log_probs:
            return None
        entries = []
        for token_id, lp in zip(token_ids, log_probs, strict=False):
            text = self._pre.token_text(token_id)
            entries.append(ChatTokenLogprob(token=text, logprob=float(lp), bytes=list(text.encode()), top_logprobs=[]))
        self.chat.extend(entries)
        return ChatLogprobs(content=entries)

    def add_completion(self, token_ids: list[int], log_probs: list[float] | None) -> CompletionLogprobs | None:
        if not log_probs:
            return None
        tokens, lps, offsets = [], [], []
        for token_id, lp in zip(token_ids, log_probs, strict=False):
            text = self._pre.token_text(token_id)
            tokens.append(text)
            lps.append(float(lp))
            offsets.append(self._offset)
            self._offset += len(text)
        self.tokens.extend(tokens)
        self.token_logprobs.extend(lps)
        self.offsets.extend(offsets)
        return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=None, text_offset=offsets)

    def chat_total(self) -> ChatLogprobs | None:
        return ChatLogprobs(content=self.chat) if self.chat else None

    def completion_total(self) -> CompletionLogprobs | None:
        if not self.tokens:
            return None
        return CompletionLogprobs(
            tokens=self.tokens, token_logprobs=self.token_logprobs, top_logprobs=None, text_offset=self.offsets
        )


class _Formatter:
    """What both response formatters share: the response id, timestamps and usage options."""

    object_prefix = ""

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


class ChatFormatter(_Formatter):
    object_prefix = "chatcmpl-"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent_role = False

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | None,
        usage: UsageInfo | None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        if self._sent_role:
            delta = ChatDelta(content=text)
        else:
            self._sent_role = True
            delta = ChatDelta(role="assistant", content=text)
        if self._token_ids:
            choice: ChatChunkChoice = ChatChunkChoiceTokens(
                index=0, delta=delta, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids or []
            )
        else:
            choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        choices = [choice]
        if self._with_usage:
            return sse(
                ChatCompletionChunkWithUsage(
                    id=self.id, created=self.created, model=self.model, choices=choices,
                    usage=usage if self._continuous else None,
                )
            )
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return sse(ChatCompletionChunkWithUsage(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))

    def response(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | None,
        usage: UsageInfo,
        token_ids: list[int] | None = None,
    ) -> bytes:
        message = ChatMessage(role="assistant", content=text)
        if self._token_ids:
            choice: ChatChoice = ChatChoiceTokens(
                index=0, message=message, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids or []
            )
        else:
            choice = ChatChoice(index=0, message=message, finish_reason=finish_reason, logprobs=logprobs)
        return encoder.encode(ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage))


class CompletionFormatter(_Formatter):
    object_prefix = "cmpl-"

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: CompletionLogprobs | None,
        usage: UsageInfo | None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        choices = [self._choice(text, finish_reason, logprobs, token_ids)]
        if self._with_usage:
            return sse(
                CompletionChunkWithUsage(
                    id=self.id, created=self.created, model=self.model, choices=choices,
                    usage=usage if self._continuous else None,
                )
            )
        return sse(CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return sse(CompletionChunkWithUsage(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))

    def _choice(
        self, text: str, finish_reason: str | None, logprobs: CompletionLogprobs | None, token_ids: list[int] | None
    ) -> CompletionChoice:
        if self._token_ids:
            return CompletionChoiceTokens(
                index=0, text=text, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids or []
            )
        return CompletionChoice(index=0, text=text, finish_reason=finish_reason, logprobs=logprobs)

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
