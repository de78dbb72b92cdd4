"""Spans and request summaries as the cluster serves them, and the Requests view's board.

A span arrives as JSON from a frontend's ``GET /v1/traces`` or a worker's ``traces`` control
endpoint (issue 30; the writer is ``shared/observability/tracing.py``, whose names this reads): ``trace_id`` (32 hex), ``span_id`` (16 hex), ``parent_id`` (16 hex or null),
``name``, ``component``, ``instance_id`` (hex or null), ``start_unix_ns``/``end_unix_ns``, ``status``
and ``attributes`` (``request_id``, ``model``, ``worker_id``, ``role``...). ``parse_span`` checks one
and says what is wrong with it, so a process serving a malformed span costs that span, not the
timeline. A frontend's ``?slowest=N`` lists ``RequestSummary`` rows; ``RequestBoard`` merges the
lists of every frontend for the Requests view and keeps why a frontend gave none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamod.console.state.versions import Versions
from dynamod.shared.observability.tracing import COMPONENTS, STATUS_ERROR, STATUS_OK

_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_SPAN_ID = re.compile(r"[0-9a-f]{16}")
_HEX = re.compile(r"[0-9a-f]+")

AttrValue = str | int | float | bool


class SpanError(ValueError):
    """A span (or summary) that does not follow the contract; the message names the field."""


@dataclass(frozen=True, slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    component: str
    instance_id: str | None
    start_unix_ns: int
    end_unix_ns: int
    status: str
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_unix_ns - self.start_unix_ns)

    @property
    def request_id(self) -> str | None:
        rid = self.attributes.get("request_id")
        return str(rid) if rid is not None else None

    @property
    def worker_hex(self) -> str | None:
        """The worker that ran the span: the ``worker_id`` attribute, else the process's instance."""
        wid = self.attributes.get("worker_id")
        return str(wid).lower() if isinstance(wid, str) and wid else self.instance_id

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id, "span_id": self.span_id, "parent_id": self.parent_id, "name": self.name,
            "component": self.component, "instance_id": self.instance_id, "start_unix_ns": self.start_unix_ns,
            "end_unix_ns": self.end_unix_ns, "status": self.status, "attributes": dict(self.attributes),
        }


def _field(obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):  # no field of the contract is a bool
        raise SpanError(f"{name} is {value!r}")
    return value


def _hex_id(value: Any, name: str, pattern: re.Pattern[str], *, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value.lower()):
        raise SpanError(f"{name} is {value!r}")
    return value.lower()


def parse_span(obj: Any) -> Span:
    """A span from its JSON form; ``SpanError`` names the first field that breaks the contract."""
    if not isinstance(obj, Mapping):
        raise SpanError(f"not an object: {type(obj).__name__}")
    start = _field(obj, "start_unix_ns", int)
    end = _field(obj, "end_unix_ns", int)
    if end < start:
        raise SpanError(f"end_unix_ns {end} is before start_unix_ns {start}")
    component = _field(obj, "component", str)
    if component not in COMPONENTS:
        raise SpanError(f"component is {component!r}")
    status = _field(obj, "status", str)
    if status not in (STATUS_OK, STATUS_ERROR):
        raise SpanError(f"status is {status!r}")
    attrs = obj.get("attributes") or {}
    if not isinstance(attrs, Mapping):
        raise SpanError(f"attributes is {attrs!r}")
    return Span(
        trace_id=_hex_id(obj.get("trace_id"), "trace_id", _TRACE_ID) or "",
        span_id=_hex_id(obj.get("span_id"), "span_id", _SPAN_ID) or "",
        parent_id=_hex_id(obj.get("parent_id"), "parent_id", _SPAN_ID, nullable=True),
        name=_field(obj, "name", str),
        component=component,
        instance_id=_hex_id(obj.get("instance_id"), "instance_id", _HEX, nullable=True),
        start_unix_ns=start,
        end_unix_ns=end,
        status=status,
        attributes={str(k): v for k, v in attrs.items() if isinstance(v, str | int | float | bool)},
    )


def parse_spans(items: Any, source: str) -> tuple[list[Span], list[str]]:
    """The valid spans of one source's answer, and a note per span left out (or for an answer
    that is not a list at all)."""
    if not isinstance(items, list):
        return [], [f"{source}: spans is {type(items).__name__}, not a list"]
    spans: list[Span] = []
    notes: list[str] = []
    for item in items:
        try:
            spans.append(parse_span(item))
        except SpanError as exc:
            notes.append(f"{source}: span left out: {exc}")
    return spans, notes


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """One row of a frontend's ``?slowest=N``."""

    request_id: str
    trace_id: str | None
    model: str
    start_unix_ns: int
    duration_ms: float
    ttft_ms: float | None
    status: str
    worker_ids: tuple[str, ...]
    migrated: bool
    source: str = ""  # the frontend that served it

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "trace_id": self.trace_id, "model": self.model,
                "start_unix_ns": self.start_unix_ns, "duration_ms": self.duration_ms, "ttft_ms": self.ttft_ms,
                "status": self.status, "worker_ids": list(self.worker_ids), "migrated": self.migrated}


def parse_summary(obj: Any, source: str = "") -> RequestSummary:
    if not isinstance(obj, Mapping):
        raise SpanError(f"not an object: {type(obj).__name__}")
    rid = _field(obj, "request_id", str)
    duration = _field(obj, "duration_ms", (int, float))
    ttft = obj.get("ttft_ms")
    if ttft is not None and (not isinstance(ttft, int | float) or isinstance(ttft, bool)):
        raise SpanError(f"ttft_ms is {ttft!r}")
    workers = obj.get("worker_ids") or []
    if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
        raise SpanError(f"worker_ids is {workers!r}")
    trace_id = obj.get("trace_id")
    return RequestSummary(
        request_id=rid,
        trace_id=trace_id if isinstance(trace_id, str) else None,
        model=str(obj.get("model") or ""),
        start_unix_ns=int(obj.get("start_unix_ns") or 0),
        duration_ms=float(duration),
        ttft_ms=float(ttft) if ttft is not None else None,
        status=str(obj.get("status") or STATUS_OK),
        worker_ids=tuple(w.lower() for w in workers),
        migrated=bool(obj.get("migrated")),
        source=source,
    )


class RequestBoard:
    """The slowest recent requests, merged over every frontend that answered its last poll.

    Each frontend's list replaces what it said before (its ring buffer moved on); a request seen
    by two frontends (a retried id) is shown once, with its longer duration. ``problems`` says why
    a frontend gave no list, so an empty view explains itself.
    """

    def __init__(self, versions: Versions, clock: Callable[[], float]) -> None:
        self._versions = versions
        self._clock = clock
        self._by_source: dict[str, list[RequestSummary]] = {}
        self._failed: dict[str, str] = {}
        self.polled_at: float | None = None

    def apply(self, source: str, rows: Iterable[RequestSummary]) -> None:
        self._by_source[source] = list(rows)
        self._failed.pop(source, None)
        self.polled_at = self._clock()
        self._versions.requests += 1

    def failed(self, source: str, reason: str) -> None:
        self._by_source.pop(source, None)
        self._failed[source] = reason
        self.polled_at = self._clock()
        self._versions.requests += 1

    def polled_none(self) -> None:
        """A poll found no frontend to ask: the view says so instead of waiting for an answer."""
        if self.polled_at is None:
            self._versions.requests += 1
        self.polled_at = self._clock()

    def forget(self, source: str) -> None:
        if self._by_source.pop(source, None) is not None or self._failed.pop(source, None) is not None:
            self._versions.requests += 1

    def sources(self) -> list[str]:
        return sorted({*self._by_source, *self._failed})

    def problems(self) -> list[str]:
        return [self._failed[s] for s in sorted(self._failed)]

    def slowest(self, limit: int | None = None) -> list[RequestSummary]:
        best: dict[str, RequestSummary] = {}
        for rows in self._by_source.values():
            for r in rows:
                seen = best.get(r.request_id)
                if seen is None or r.duration_ms > seen.duration_ms:
                    best[r.request_id] = r
        out = sorted(best.values(), key=lambda r: (-r.duration_ms, r.request_id))
        return out[:limit] if limit is not None else out
