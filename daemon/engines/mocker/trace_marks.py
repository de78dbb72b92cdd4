"""The mocker's engine-side spans of one traced request: queue, prompt compute, KV transfer, decode.

The engine notes four instants (``added`` when the request joins the core, ``scheduled`` when a
step first computes its prompt (the step's start), ``first_token``, ``end``) and, for a decode
worker fed by a prefill worker, the KV read (its bytes and time, from the transfer report). They
become children of the worker's ``handle_payload`` span when the request ends:

    engine.queue    added -> scheduled (or the first token, when no prompt was computed here)
    kv_transfer     the read of the prompt's KV (decode workers of a disaggregated model)
    engine.prefill  scheduled -> first token
    engine.decode   first token -> end

Only requests whose span records get marks (``MockerEngine`` keeps them in a dict that is empty
otherwise), so an untraced engine pays one truth test per step.
"""

from __future__ import annotations

import time
from typing import Any

from dynamod.shared.observability import tracing


class TraceMarks:
    __slots__ = ("added_ns", "end_ns", "finish_reason", "first_ns", "parent", "scheduled_ns", "tokens", "transfer")

    def __init__(self, parent: tracing.Span) -> None:
        self.parent = parent
        self.added_ns = time.time_ns()
        self.scheduled_ns = 0
        self.first_ns = 0
        self.end_ns = 0
        self.tokens = 0
        self.finish_reason: str | None = None
        self.transfer: tuple[int, int, dict[str, Any]] | None = None  # (start ns, end ns, report)

    def scheduled(self, step_start_ns: int) -> None:
        if not self.scheduled_ns:
            self.scheduled_ns = step_start_ns

    def output(self, num_tokens: int, finish_reason: str | None) -> None:
        if num_tokens and not self.first_ns:
            self.first_ns = time.time_ns()
        self.tokens += num_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.end_ns = time.time_ns()

    def transferred(self, report: dict[str, Any]) -> None:
        end = time.time_ns()
        ms = report.get("ms")
        start = end - int(float(ms) * 1e6) if isinstance(ms, int | float) else end
        self.transfer = (max(start, self.added_ns), end, report)

    def emit(self) -> None:
        """Records the spans (called once, when the request's stream ends)."""
        tr = tracing.tracer()
        parent = self.parent
        end = self.end_ns or time.time_ns()
        first = self.first_ns or end
        scheduled = self.scheduled_ns or first
        scheduled = min(max(scheduled, self.added_ns), first)
        queue = tr.child(parent, tracing.SPAN_ENGINE_QUEUE)
        if queue is not None:
            queue.start_unix_ns = self.added_ns
            queue.end(scheduled if scheduled > self.added_ns else self.added_ns + 1)
        if self.transfer is not None:
            start, stop, report = self.transfer
            span = tr.child(
                parent, tracing.SPAN_KV_TRANSFER, bytes=report.get("bytes"), ms=report.get("ms"),
                ok=bool(report.get("ok", False)), blocks=report.get("blocks"), reason=report.get("reason"),
                source_worker_id=report.get("source_worker_id"),
            )
            if span is not None:
                span.start_unix_ns = start
                if not report.get("ok", False):
                    span.fail(str(report.get("reason") or "transfer failed"))
                span.end(max(stop, start + 1))
        prefill = tr.child(parent, tracing.SPAN_ENGINE_PREFILL, first_token=self.first_ns != 0)
        if prefill is not None:
            prefill.start_unix_ns = scheduled
            prefill.end(max(first, scheduled + 1))
        if self.first_ns:
            decode = tr.child(parent, tracing.SPAN_ENGINE_DECODE, completion_tokens=self.tokens, finish_reason=self.finish_reason)
            if decode is not None:
                decode.start_unix_ns = self.first_ns
                decode.end(max(end, self.first_ns + 1))
