"""Gathers one request's trace from the cluster: the one code path behind ``dynamoctl trace`` and
the console's waterfall (Enter in the Requests view).

No tracing backend is needed (issue 30): every frontend keeps recent spans behind ``GET
/v1/traces`` and every worker (each role) behind its ``traces`` control endpoint. ``gather`` asks all
of them for the request id, picks the trace the request belongs to, asks all of them again for that
trace id (a router or transfer span may not carry the request id), and merges the answers: a span
reported twice (two frontends of a fleet, a retried read) is kept once. A frontend or worker that
does not answer, or does not serve ``traces`` (an older build), costs its spans and a note, never
the timeline; a request nobody knows is ``UnknownRequestError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from dynamod.console.actions.control import ControlClient
from dynamod.console.collectors.scraper import FrontendHttp
from dynamod.console.collectors.traces import fetch_spans
from dynamod.console.state.traces import Span, parse_spans
from dynamod.shared.errors import DynamoError, NotFoundError
from dynamod.shared.protocol import control
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.security.printable import printable

logger = logging.getLogger(__name__)

TRACES_ENDPOINT = control.TRACES
SPAN_LIMIT = 2000  # spans asked of each process per round: a long agent turn has a few hundred
WORKER_TIMEOUT_S = 3.0
FRONTEND_COMPONENTS = frozenset({"frontend", "http"})
GENERATE = "generate"


class UnknownRequestError(NotFoundError):
    """No frontend or worker holds a span of this request (never sampled, or aged out)."""


@dataclass(slots=True)
class GatheredTrace:
    request_id: str
    trace_id: str
    spans: list[Span]  # sorted by start, one per span id
    notes: list[str] = field(default_factory=list)  # sources skipped and why, spans left out
    sources: int = 0  # frontends and workers asked

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "trace_id": self.trace_id, "spans": [s.to_dict() for s in self.spans]}


@dataclass(slots=True)
class Round:
    """What one round of asking gave."""

    spans: list[Span]
    notes: list[str]
    frontends: list[str]  # the frontend URLs that were there to ask
    failed: int  # sources that gave notes and no span (no answer, refused, malformed)


def merge_spans(batches: Iterable[Iterable[Span]]) -> list[Span]:
    """One span per span id, sorted by start (then end, then id, so the order is stable). Of two
    copies the one that ended later wins: a span re-read after it closed carries its final end."""
    by_id: dict[str, Span] = {}
    for batch in batches:
        for span in batch:
            seen = by_id.get(span.span_id)
            if seen is None or span.end_unix_ns > seen.end_unix_ns:
                by_id[span.span_id] = span
    return sorted(by_id.values(), key=lambda s: (s.start_unix_ns, s.end_unix_ns, s.span_id))


def pick_trace(request_id: str, spans: list[Span]) -> tuple[str, list[str]]:
    """The trace ``request_id`` belongs to: the one with most of its spans tagged with the id
    (the earliest on a tie), and a note for any other trace the id also appears in."""
    tagged = [s for s in spans if s.request_id == request_id] or spans
    counts = Counter(s.trace_id for s in tagged)
    first: dict[str, int] = {}
    for s in sorted(tagged, key=lambda s: s.start_unix_ns):
        first.setdefault(s.trace_id, s.start_unix_ns)
    chosen = max(counts, key=lambda t: (counts[t], -first[t]))
    notes = [f"request {request_id} also appears in trace {t} ({n} spans): showing trace {chosen}"
             for t, n in counts.items() if t != chosen]
    return chosen, notes


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def is_frontend(rec: Instance) -> bool:
    return rec.role in FRONTEND_COMPONENTS or rec.component in FRONTEND_COMPONENTS


class TraceGatherer:
    """Asks every frontend (``frontends()``: their ``/v1/traces`` URLs) and every worker found in
    discovery (through ``control``) for the spans of one request."""

    def __init__(
        self,
        control: ControlClient,
        frontends: Callable[[], list[str]],
        http: FrontendHttp,
        *,
        guessed: frozenset[str] = frozenset(),
        worker_timeout_s: float = WORKER_TIMEOUT_S,
        limit: int = SPAN_LIMIT,
    ) -> None:
        self._control = control
        self._frontends = frontends
        self._http = http
        self._guessed = guessed
        self._worker_timeout_s = worker_timeout_s
        self._limit = limit

    async def gather(self, request_id: str) -> GatheredTrace:
        request_id = request_id.strip()
        if not request_id:
            raise NotFoundError("empty request id")
        workers, notes = await self._workers()
        urls = self._frontends()
        async with self._http.client() as client:
            first = await self._round(client, urls, workers, request_id=request_id)
            urls = first.frontends
            if not first.spans:
                why = f"; {first.failed} of them gave no answer" if first.failed else ""
                raise UnknownRequestError(
                    f"no spans for request {request_id}: asked {plural(len(urls), 'frontend')} and "
                    f"{plural(len(workers), 'worker')}{why} (only recent, sampled requests are kept)")
            trace_id, pick_notes = pick_trace(request_id, first.spans)
            second = await self._round(client, urls, workers, trace_id=trace_id)
        spans = [s for s in merge_spans((first.spans, second.spans)) if s.trace_id == trace_id]
        # A source that failed both rounds is named once.
        notes += list(dict.fromkeys(first.notes + second.notes)) + pick_notes
        return GatheredTrace(request_id, trace_id, spans, notes, len(urls) + len(workers))

    async def _workers(self) -> tuple[list[Instance], list[str]]:
        """The ``traces`` records to ask, and a note per worker that serves none."""
        records = await self._control.instances()
        serving = {r.instance_id: r for r in records if r.endpoint == TRACES_ENDPOINT}
        # Workers and routers serve ``generate``; a planner or a frontend has no spans to miss.
        others = {r.instance_id: r for r in records
                  if r.endpoint == GENERATE and not is_frontend(r) and r.instance_id not in serving}
        notes = [f"worker {worker_id_hex(i)} ({printable(r.component)}) does not serve {TRACES_ENDPOINT}: skipped"
                 for i, r in sorted(others.items())]
        return [serving[i] for i in sorted(serving)], notes

    async def _round(
        self, client: httpx.AsyncClient, urls: list[str], workers: list[Instance], *,
        request_id: str | None = None, trace_id: str | None = None,
    ) -> Round:
        """One round over every source (a guessed frontend address with nothing listening is not one)."""
        params = {"request_id": request_id} if request_id is not None else {"trace_id": trace_id or ""}
        body = control.encode_body(control.TracesRequest(request_id=request_id, trace_id=trace_id, limit=self._limit))
        fronts, backs = await asyncio.gather(
            asyncio.gather(*(fetch_spans(self._http, client, u, params, self._guessed) for u in urls)),
            asyncio.gather(*(self._ask_worker(rec, body) for rec in workers)),
        )
        present = [u for u, a in zip(urls, fronts, strict=True) if a is not None]
        answers = [a for a in fronts if a is not None] + list(backs)
        return Round(
            spans=[s for got, _ in answers for s in got],
            notes=[n for _, got_notes in answers for n in got_notes],
            frontends=present,
            failed=sum(1 for got, got_notes in answers if not got and got_notes),
        )

    async def _ask_worker(self, rec: Instance, body: dict[str, Any]) -> tuple[list[Span], list[str]]:
        label = f"worker {worker_id_hex(rec.instance_id)}"
        try:
            reply = await asyncio.wait_for(
                self._control.call_instance(rec, body, timeout_s=self._worker_timeout_s), self._worker_timeout_s + 1.0)
        except TimeoutError:
            return [], [f"{label}: no answer within {self._worker_timeout_s:g}s: skipped"]
        except (DynamoError, OSError) as exc:
            return [], [f"{label}: {printable(str(exc) or type(exc).__name__)}: skipped"]
        if reply.get("status") != control.STATUS_OK:
            return [], [f"{label}: {printable(reply.get('message') or 'failed')}: skipped"]
        return parse_spans(reply.get("spans", []), label)
