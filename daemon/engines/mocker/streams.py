"""Per-request output collectors between the step loop and ``generate()`` consumers.

Like vLLM's ``RequestOutputCollector``, each request has one slot: the step loop appends the
step's token to the pending output and wakes the consumer; a consumer that fell behind takes all
pending tokens at once in one ``EngineOutput``. So the step loop never blocks on a slow client,
and memory per request is bounded by its own ``max_tokens`` rather than by a queue of frames.

A streamed prefill (KV transfer overlapped with it) also sends one early output with no tokens
and its transfer parameters (``push_params``), before the prefill ends.
"""

from __future__ import annotations

import asyncio

from dynamod.shared.protocol.llm import EngineOutput, Usage


class RequestStream:
    """The pending output of one request; one producer (the step loop), one consumer."""

    __slots__ = (
        "request_id", "dp_rank", "prompt_tokens", "num_tokens", "_tokens", "_finish_reason", "_usage", "_error",
        "_waiter", "_closed", "final_params", "_log_probs", "_top", "_early_params", "_attached",
    )

    def __init__(self, request_id: str, dp_rank: int, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.dp_rank = dp_rank
        self.prompt_tokens = prompt_tokens
        self.num_tokens = 0  # tokens produced so far (for the usage of an aborted request)
        self._tokens: list[int] = []
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False  # the final output was taken
        self.final_params: dict | None = None  # disaggregated_params for the final output
        # Parallel to ``_tokens`` for a request that asked for log-probabilities (None: it did not).
        self._log_probs: list[float] | None = None
        self._top: list[list[tuple[int, float]]] | None = None
        self._early_params: dict | None = None  # disaggregated_params for an output before the end
        self._attached: dict | None = None  # disaggregated_params riding on the next tokens' output

    def push(self, token: int) -> None:
        self._tokens.append(token)
        self.num_tokens += 1
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def push_logprob(self, logprob: float, top: list[tuple[int, float]] | None) -> None:
        """The log-probability (and top alternatives) of the token last pushed."""
        if self._log_probs is None:
            self._log_probs = []
        self._log_probs.append(logprob)
        if top is not None:
            if self._top is None:
                self._top = []
            self._top.append(top)

    def push_params(self, params: dict) -> None:
        """Sends ``params`` in an output of their own, ahead of the request's tokens."""
        self._early_params = params
        self._wake()

    def attach_params(self, params: dict) -> None:
        """Sends ``params`` with the next tokens (a decode's transfer report with its first token)."""
        self._attached = params

    def finish(self, reason: str, usage: Usage | None) -> None:
        self._finish_reason = reason
        self._usage = usage
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None or self._error is not None

    async def get(self) -> EngineOutput:
        """Waits for new tokens or the end; the output with ``finish_reason`` set is the last."""
        if self._closed:
            raise RuntimeError(f"stream {self.request_id!r} already ended")
        while not self._tokens and self._finish_reason is None and self._error is None and self._early_params is None:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        if self._error is not None:
            self._closed = True
            raise self._error
        early = self._early_params
        if early is not None:
            self._early_params = None
            return EngineOutput(token_ids=[], disaggregated_params=early)
        tokens = self._tokens
        self._tokens = []
        if self._log_probs is None:
            out = EngineOutput(token_ids=tokens)
        else:
            out = EngineOutput(token_ids=tokens, log_probs=self._log_probs, top_logprobs=self._top)
            self._log_probs = []
            if self._top is not None:
                self._top = []
        if self._finish_reason is None:
            if self._attached is not None:
                out.disaggregated_params, self._attached = self._attached, None
            return out
        self._closed = True
        out.finish_reason = self._finish_reason
        out.usage = self._usage
        out.disaggregated_params = self.final_params
        return out
