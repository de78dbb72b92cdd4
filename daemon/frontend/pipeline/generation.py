"""Engine token stream -> text deltas: incremental detokenization and stop strings.

Sits between ``EngineStream`` (token ids, across migrations) and the response formatters. A delta
is produced only when there is something to send: text (never half a character) or a finish
reason. Tokens whose text is held back ride along with the next delta, so the token ids (and
log-probabilities) of all deltas add up to exactly what the engine generated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from dynamod.daemon.frontend.pipeline.dispatch import EngineStream
from dynamod.daemon.frontend.preprocess import Detokenizer, StopStringMatcher
from dynamod.shared.errors import EngineError
from dynamod.shared.protocol.llm import FINISH_ERROR, FINISH_STOP

if TYPE_CHECKING:
    from dynamod.daemon.frontend.pipeline.metrics import ModelMetrics
    from dynamod.daemon.frontend.pipeline.request import EngineRequest


class Delta:
    __slots__ = ("text", "token_ids", "log_probs", "finish_reason", "top_logprobs")

    def __init__(
        self,
        text: str,
        token_ids: list[int],
        log_probs: list[float] | None,
        finish_reason: str | None,
        top_logprobs: list[Any] | None = None,
    ) -> None:
        self.text = text
        self.token_ids = token_ids
        self.log_probs = log_probs
        self.finish_reason = finish_reason
        # Per token: its most likely alternatives as [token id, logprob] pairs (top_logprobs).
        self.top_logprobs = top_logprobs


# Yielded (when asked for) where the engine's output so far gives no text yet and nothing more has
# arrived: a streaming caller that holds chunks back must send them now rather than wait.
IDLE = Delta("", [], None, None)


class TextGeneration:
    """Iterate for ``Delta``s; ``aclose`` stops the engine request if it is still running.

    Callers (the response writers, the fan-out, ``serve``) read what they need here: the token
    counts for usage, the output token ids, where the generation ran (``request``) and the metrics
    of the model that served it, never through the engine stream beneath."""

    def __init__(
        self,
        engine: EngineStream,
        detokenizer: Detokenizer,
        stops: list[str],
        *,
        want_logprobs: bool,
    ) -> None:
        self.engine = engine
        self._detok = detokenizer
        self._matcher = StopStringMatcher(stops) if stops else None
        self._want_logprobs = want_logprobs
        self.finish_reason: str | None = None
        self._stopped_after: int | None = None
        self.yield_idle = False  # see IDLE
        self._gen = self._run()

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, up to the one that completed a stop string (an engine frame may
        carry tokens past it, which the client never sees and is not billed for)."""
        if self._stopped_after is not None:
            return self._stopped_after
        return len(self.engine.generated)

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids the client is billed for (up to a completed stop string)."""
        return self.engine.generated[: self.completion_tokens]

    @property
    def stop_sequence(self) -> str | None:
        """The request's stop string that ended the output (None: it ended otherwise)."""
        return self._matcher.matched if self._matcher is not None else None

    @property
    def prompt_tokens(self) -> int:
        return self.engine.prompt_len

    @property
    def cached_tokens(self) -> int:
        return self.engine.cached_tokens

    @property
    def request(self) -> EngineRequest:
        """This generation's routing record: the worker that answered, the disaggregation
        decision, the route explanation (filled as the engine stream runs)."""
        return self.engine.request  # type: ignore[no-any-return]

    @property
    def metrics(self) -> ModelMetrics:
        """The metrics of the model serving it (after the model was replaced while the request
        waited: the new one)."""
        return self.engine.request.model.metrics  # type: ignore[no-any-return]

    @property
    def ready(self) -> bool:
        """The engine's next output has already arrived: the next delta is computed without
        waiting, so the caller may hold what it has and send both together (one write)."""
        return self.engine.buffered > 0

    def __aiter__(self) -> TextGeneration:
        return self

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()
        await self.engine.aclose()

    async def _run(self) -> AsyncIterator[Delta]:
        detok = self._detok
        matcher = self._matcher
        want_logprobs = self._want_logprobs
        # Tokens whose text is still held back (half a character, a possible stop string) travel
        # with the next delta, so a delta's token ids always add up to what was generated.
        carry: list[int] = []
        carry_lp: list[float] = []
        carry_top: list[Any] = []
        seen = 0  # tokens received before this frame
        async for out in self.engine:
            new_tokens = out.get("token_ids") or []
            finish = out.get("finish_reason")
            if finish == FINISH_ERROR:
                raise EngineError(f"the engine failed the request: {out.get('error') or 'no detail'}")
            log_probs = out.get("log_probs") if want_logprobs else None
            top = out.get("top_logprobs") if want_logprobs else None
            matched: str | None = None
            if matcher is None:
                text = detok.add_tokens(new_tokens) if new_tokens else ""
                if finish is not None:
                    text += detok.flush()
            else:
                # Token by token: a stop string ends the output at the token that completed it,
                # even when the engine sent more tokens in the same frame.
                text = ""
                kept = len(new_tokens)
                for i, token in enumerate(new_tokens):
                    piece, matched = matcher.feed(detok.add_token(token))
                    text += piece
                    if matched is not None:
                        kept = i + 1
                        break
                if matched is None and finish is not None:
                    piece, matched = matcher.feed(detok.flush())
                    text += piece
                if kept < len(new_tokens):
                    new_tokens = new_tokens[:kept]
                    if log_probs is not None:
                        log_probs = log_probs[:kept]
                    if top is not None:
                        top = top[:kept]
            if carry:
                tokens = carry + new_tokens
                if log_probs is not None:
                    log_probs = carry_lp + log_probs
                if top is not None:
                    top = carry_top + top
                carry, carry_lp, carry_top = [], [], []
            else:
                tokens = new_tokens
            seen += len(new_tokens)
            if matcher is not None:
                if matched is not None:
                    self._stopped_after = seen
                    self.finish_reason = FINISH_STOP
                    yield Delta(text, tokens, log_probs, FINISH_STOP, top)
                    return
                if finish is not None:
                    text += matcher.flush()
            if finish is not None:
                self.finish_reason = finish
            if text or finish is not None:
                yield Delta(text, tokens, log_probs, finish, top)
                if finish is not None:
                    return
            else:
                carry = tokens
                if log_probs is not None:
                    carry_lp = log_probs
                if top is not None:
                    carry_top = top
                if self.yield_idle and not self.engine.buffered:
                    yield IDLE
