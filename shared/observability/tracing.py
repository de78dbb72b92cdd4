"""Request traces without a tracing backend: spans, W3C ``traceparent``, sampling and a ring buffer.

Every process has one ``Tracer`` (``tracer()``). A span is a plain object with the fields of the
wire contract (``Span.to_dict``): ``trace_id`` (32 hex), ``span_id`` (16 hex), ``parent_id``,
``name``, ``component`` (frontend, router, prefill, decode, agg, encode), ``instance_id`` (hex),
start and end in Unix nanoseconds, ``status`` (ok, error) and flat ``attributes``; every span's
attributes carry ``request_id`` (the client-visible ``x-request-id``) and ``model``, and, where
known, ``worker_id`` and ``role``. Ended spans go to the process's ``SpanRing`` (recent requests,
bounded by request count and span count, served by the workers' ``traces`` control endpoint and
the frontend's ``GET /v1/traces``) and, when an OTLP exporter is configured (``tracing_otel``,
the optional ``trace`` extra), to it as well. The ring works without OpenTelemetry installed.

Propagation: the frontend's request span is the root; each request-plane stream opened while a
span is current (``use_span``) carries ``traceparent`` (and ``x-request-id``) in its frame
headers (``shared/transport/client_stream.py``, the same for TCP and NATS), and the serving side
continues the trace from ``RequestContext.headers`` (``start_span(parent=headers_context(...))``).

Sampling is decided once, at the head (the frontend), and travels in the ``traceparent`` flags:
``--trace-sample-rate`` (``DYN_TRACE_SAMPLE_RATE``, default 1.0: recording into the local ring is
cheap) is the fraction of requests whose spans are recorded. An unsampled request still keeps a
root span object (a few attributes; no ids are made for it, it propagates a fixed not-sampled
``traceparent``); it is recorded anyway when the request fails or migrates, and a migration switches recording on for the rest of the request (``promote``), so the
new worker's spans and the migration itself are kept. Export has its own ratio on top of that
(OTLP's standard ``OTEL_TRACES_SAMPLER_ARG``, see ``tracing_otel``), errors and migrations always
exported.

Why our own span objects rather than the OpenTelemetry API's: the ring buffer and the views must
work where the SDK is not installed, and a span here costs a few microseconds on the frontend's
per-request path (``bench/tracing_cost.py``), where the SDK's context machinery would cost several
times that. The SDK is used where it is the standard: OTLP export (``tracing_otel``).
"""

from __future__ import annotations

import contextvars
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from dynamod.shared.observability.logging import REQUEST_ID as LOG_REQUEST_ID

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
REQUEST_ID_HEADER = "x-request-id"

COMPONENTS = ("frontend", "router", "prefill", "decode", "agg", "encode")
# What a child span copies from its parent (``Tracer.child``), so every span names its request.
INHERITED_ATTRIBUTES = ("request_id", "model", "worker_id", "role")
STATUS_OK = "ok"
STATUS_ERROR = "error"

# Span names: Dynamo's where it has them (``http-request`` at the frontend, ``client_request`` for
# a request-plane call, ``handle_payload`` on the serving side), ours for the stages it does not name.
SPAN_HTTP_REQUEST = "http-request"
SPAN_PREPROCESS = "preprocess"  # chat template + tokenize
SPAN_ROUTE = "route"  # the router's decision; its explain numbers as attributes
SPAN_PREFILL = "prefill"  # the remote prefill stage, frontend side
SPAN_CLIENT_REQUEST = "client_request"  # one decode/agg attempt on one worker, frontend side
SPAN_MIGRATION = "migration"
SPAN_OUTPUT_PARSE = "output_parse"  # tool-call / reasoning parsing of the output
SPAN_HANDLE_PAYLOAD = "handle_payload"  # a worker serving one request
SPAN_ENGINE_QUEUE = "engine.queue"
SPAN_ENGINE_PREFILL = "engine.prefill"  # scheduled -> first token (prompt compute)
SPAN_ENGINE_DECODE = "engine.decode"  # first token -> completion
SPAN_KV_TRANSFER = "kv_transfer"  # a decode worker reading the prompt's KV from a prefill worker

DEFAULT_SAMPLE_RATE = 1.0
# ``--trace-sample-rate off`` / ``DYN_TRACE_SAMPLE_RATE=off``: no tracing at all. The frontend makes
# no root span and sends no ``traceparent``; no process keeps a span (not even a failed request's).
# Rate 0 is different: nothing sampled, but errors and migrations are still recorded.
TRACING_OFF = "off"
TRACING_OFF_NOTE = "tracing is off in this process (--trace-sample-rate off): it keeps no spans"
DEFAULT_RING_REQUESTS = 2000
DEFAULT_RING_SPANS = 50_000
MAX_REQUEST_ID_LEN = 128

AttrValue = str | int | float | bool

_rand = random.Random()  # ids need uniqueness, not secrecy; reseeded after fork (below)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_rand.seed)


def new_trace_id() -> str:
    # to_bytes().hex(): the cheapest way to lower-case fixed-width hex (on every request's path;
    # cheaper than a string format, and than slicing ids from a pool of random hex).
    return (_rand.getrandbits(128) or 1).to_bytes(16, "big").hex()


def new_span_id() -> str:
    return (_rand.getrandbits(64) or 1).to_bytes(8, "big").hex()


# -- W3C trace context ------------------------------------------------------------------------------


class SpanContext:
    """What crosses a process boundary: the trace, the parent span and the sampled flag."""

    __slots__ = ("sampled", "span_id", "trace_id")

    def __init__(self, trace_id: str, span_id: str, sampled: bool) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = sampled

    def __repr__(self) -> str:
        return f"SpanContext({format_traceparent(self)})"


_HEX = frozenset("0123456789abcdef")


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and set(text) <= _HEX and text.strip("0") != ""


def parse_traceparent(value: str | None) -> SpanContext | None:
    """``00-<trace 32 hex>-<parent 16 hex>-<flags 2 hex>`` (W3C Trace Context, level 1); None when
    absent or malformed (a malformed header starts a new trace, as the spec asks). A future version
    (not ``00``) is read by its first four fields; version ``ff`` is invalid."""
    if not value:
        return None
    parts = value.strip().lower().split("-")
    if len(parts) < 4:
        return None
    version, trace_id, span_id, flags = parts[0], parts[1], parts[2], parts[3]
    if len(version) != 2 or not set(version) <= _HEX or version == "ff":
        return None
    if version == "00" and len(parts) != 4:
        return None
    if not _is_hex(trace_id, 32) or not _is_hex(span_id, 16):
        return None
    if len(flags) != 2 or not set(flags) <= _HEX:
        return None
    return SpanContext(trace_id, span_id, bool(int(flags, 16) & 1))


def format_traceparent(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id}-{ctx.span_id}-{'01' if ctx.sampled else '00'}"


# The context every unsampled request propagates: only its "not sampled" flag matters downstream
# (nobody records under it), so no ids are made for the requests the sampler leaves out.
UNSAMPLED = SpanContext("0" * 31 + "1", "0" * 15 + "1", False)
UNSAMPLED_TRACEPARENT = format_traceparent(UNSAMPLED)


def valid_request_id(value: str) -> bool:
    """An ``x-request-id`` we accept: 1..128 printable ASCII characters, no spaces at the ends."""
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and value.isascii() and value.isprintable() and value == value.strip()


# -- spans ----------------------------------------------------------------------------------------


class Span(msgspec.Struct, eq=False, gc=False):
    """One timed operation. ``recording`` False: the span keeps its context (so children and
    remote calls share the trace) but is not stored unless it ends in error or is promoted.

    A msgspec struct rather than a class with ``__slots__`` only for its constructor, which runs
    in C (a few spans per sampled request on the frontend's path); it is never encoded as a whole
    (``SpanRing`` keeps records, ``to_dict`` is the wire form). ``eq=False``: spans are compared by
    identity. ``gc=False``: a span refers to its tracer and a dict of scalars, never to itself
    through them, so the cycle collector has nothing to find in it and need not track it. Made
    positionally: ``Span(tracer, trace_id, span_id, parent_id, name, component, instance_id,
    start_unix_ns, attributes, recording)``."""

    _tracer: Tracer | None
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    component: str
    instance_id: str | None
    start_unix_ns: int
    attributes: dict[str, AttrValue]
    recording: bool
    end_unix_ns: int = 0
    status: str = STATUS_OK

    @property
    def context(self) -> SpanContext:
        if not self.span_id:
            if not self.recording:
                return UNSAMPLED  # nobody records it: its ids would never be seen
            self._ensure_ids()
        return SpanContext(self.trace_id, self.span_id, self.recording)

    def _ensure_ids(self) -> None:
        """An unsampled span gets its ids only when it turns out to be kept (error, promotion)."""
        if not self.trace_id:
            self.trace_id = new_trace_id()
        if not self.span_id:
            self.span_id = new_span_id()

    @property
    def ended(self) -> bool:
        return self.end_unix_ns != 0

    def set(self, key: str, value: AttrValue | None) -> None:
        """Sets one attribute; None leaves it out."""
        if value is not None:
            self.attributes[key] = value

    def update(self, values: Mapping[str, AttrValue | None]) -> None:
        for key, value in values.items():
            if value is not None:
                self.attributes[key] = value

    def fail(self, error: BaseException | str) -> None:
        """Marks the span failed (an error is always recorded, sampled or not)."""
        self.status = STATUS_ERROR
        self.attributes["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def promote(self) -> None:
        """Records this span (and, through its context, the spans started from it from now on)
        although the request was not sampled: a migration or an error worth keeping."""
        self._ensure_ids()
        self.recording = True

    def end(self, end_unix_ns: int | None = None) -> None:
        """Ends the span once (later calls do nothing) and hands it to the tracer."""
        if self.end_unix_ns:
            return
        self.end_unix_ns = end_unix_ns or time.time_ns()
        if self.recording or self.status == STATUS_ERROR:
            tracer = self._tracer
            if tracer is not None:
                if not self.span_id:
                    self._ensure_ids()
                tracer.record(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "name": self.name,
            "component": self.component,
            "instance_id": self.instance_id,
            "start_unix_ns": self.start_unix_ns,
            "end_unix_ns": self.end_unix_ns or self.start_unix_ns,
            "status": self.status,
            "attributes": dict(self.attributes),
        }


# -- the ring buffer --------------------------------------------------------------------------------


# A span as the ring keeps it: one msgpack blob (``[trace_id, span_id, parent_id, name,
# component, instance_id, start, end, status, attributes]``). One bytes object per span instead of
# a Span, its dict and a dozen strings: the ring holds thousands of spans for minutes, and that
# many small long-lived objects spread the frontend's short-lived allocations over more memory,
# which cost it more CPU than recording the spans did (bench/tracing_cost.py measured it).
SpanRecord = bytes
_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder()


def record_fields(rec: SpanRecord) -> list[Any]:
    """The record's fields, in the order above."""
    return _record_decoder.decode(rec)  # type: ignore[no-any-return]


def span_from_record(rec: SpanRecord) -> Span:
    """A (non-recording, ended) ``Span`` view of a record, for readers."""
    f = record_fields(rec)
    span = Span(None, f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[9], False)
    span.end_unix_ns = f[7]
    span.status = f[8]
    return span


class SpanRing:
    """The spans of the most recent requests, oldest request evicted first once either bound is
    passed (``max_requests`` requests, ``max_spans`` spans). Keyed by the span's ``request_id``
    attribute; also found by trace id. Holds ``SpanRecord`` blobs; readers get ``Span`` views.
    Used from the event loop's thread only (the OTLP exporter's thread never touches it), so it
    takes no lock on the per-span path.

    ``add`` runs once per recorded span on the frontend's request path and ``_evict_oldest`` once
    per request when the ring is full, so both are kept to a few dictionary operations: there is
    no index by trace id to maintain; ``find(trace_id=...)``, a rare read (``dynamoctl trace``),
    scans the held requests' trace ids instead (a few thousand tuples)."""

    def __init__(self, max_requests: int = DEFAULT_RING_REQUESTS, max_spans: int = DEFAULT_RING_SPANS) -> None:
        if max_requests < 1 or max_spans < 1:
            raise ValueError("the span ring needs room for at least one request and one span")
        self.max_requests = max_requests
        self.max_spans = max_spans
        # request key -> [its trace ids (a tuple: almost always one), its records...]: one list per
        # request, appended to (replacing a tuple pair in the ordered dict on every span cost more)
        self._by_request: OrderedDict[str, list[Any]] = OrderedDict()
        self._spans = 0

    def __len__(self) -> int:
        return len(self._by_request)

    @property
    def span_count(self) -> int:
        return self._spans

    def add(self, span: Span) -> None:
        attrs = span.attributes
        trace_id = span.trace_id
        key = attrs.get("request_id") or trace_id
        if key.__class__ is not str:
            key = str(key)
        # the record's layout: see ``SpanRecord``
        rec = _record_encoder.encode((
            trace_id, span.span_id, span.parent_id, span.name, span.component, span.instance_id,
            span.start_unix_ns, span.end_unix_ns or span.start_unix_ns, span.status, attrs,
        ))
        by_request = self._by_request
        held = by_request.get(key)
        if held is None:
            by_request[key] = [(trace_id,), rec]
            if len(by_request) > self.max_requests:
                self._evict_oldest()  # never this one: it is the newest
        else:
            held.append(rec)
            if trace_id not in held[0]:
                held[0] = (*held[0], trace_id)
        self._spans += 1
        if self._spans > self.max_spans:
            while self._spans > self.max_spans and len(by_request) > 1:
                self._evict_oldest()
            if self._spans > self.max_spans:  # one request with more spans than the whole ring
                held = by_request[key]
                del held[1 : 1 + self._spans - self.max_spans]
                self._spans = self.max_spans

    def _evict_oldest(self) -> None:
        self._spans -= len(self._by_request.popitem(last=False)[1]) - 1

    def find(self, request_id: str | None = None, trace_id: str | None = None, limit: int = 1000) -> list[Span]:
        """The spans of a request and/or a trace (both None: the most recent spans), at most
        ``limit``, in start order."""
        if request_id is None and trace_id is None:
            recs = [r for held in self._by_request.values() for r in held[1:]][-limit:] if limit > 0 else []
            spans = [span_from_record(r) for r in recs]
        else:
            keys: list[str] = []
            if request_id is not None:
                keys.append(request_id)
            if trace_id is not None:
                keys.extend(k for k, held in self._by_request.items() if trace_id in held[0] and k != request_id)
            spans = [span_from_record(r) for key in keys for r in self._by_request.get(key, [()])[1:]]
            if trace_id is not None:
                spans = [s for s in spans if s.trace_id == trace_id]
        spans.sort(key=lambda s: (s.start_unix_ns, s.end_unix_ns))
        return spans[:limit] if limit >= 0 else spans

    def records(self) -> list[tuple[str, tuple[SpanRecord, ...]]]:
        """Every held request and its records, oldest first (``record_fields`` reads one)."""
        return [(key, tuple(held[1:])) for key, held in self._by_request.items()]


# -- sampling -------------------------------------------------------------------------------------


class Sampler:
    """Head sampling by ratio, decided from the trace id so every process agrees on it."""

    def __init__(self, rate: float = DEFAULT_SAMPLE_RATE) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a trace sample rate is between 0 and 1, got {rate}")
        self.rate = rate
        self._bound = int(rate * (1 << 64))

    def sample_new(self) -> bool:
        """The decision for a new trace whose ids are not made yet (a random draw)."""
        rate = self.rate
        return rate >= 1.0 or (rate > 0.0 and _rand.random() < rate)

    def sampled(self, trace_id: str) -> bool:
        if self.rate >= 1.0:
            return True
        if self.rate <= 0.0:
            return False
        return int(trace_id[16:], 16) < self._bound


# -- the process tracer -------------------------------------------------------------------------------

SpanSink = Callable[[Span], None]


class Tracer:
    """Starts spans and stores the ended ones: the ring, and the exporter when there is one."""

    def __init__(self, sampler: Sampler | None = None, ring: SpanRing | None = None) -> None:
        self.sampler = sampler if sampler is not None else Sampler()
        self.ring = ring if ring is not None else SpanRing()  # an empty ring is falsy (__len__)
        self.exporter: SpanSink | None = None
        # False (``TRACING_OFF``): callers that can skip their spans do (the frontend's root), and
        # ``record`` keeps nothing from the spans that are still made (a worker's, unsampled).
        self.enabled = True

    def switch_off(self) -> None:
        """``TRACING_OFF``: nothing sampled, nothing recorded or exported from now on."""
        self.enabled = False
        self.sampler = Sampler(0.0)

    def start_span(
        self,
        name: str,
        *,
        component: str,
        parent: Span | SpanContext | None = None,
        instance_id: str | None = None,
        attributes: dict[str, AttrValue] | None = None,
        start_unix_ns: int | None = None,
        sampled: bool | None = None,
    ) -> Span:
        """A child of ``parent`` (recording as the parent is), or a new trace's root sampled by the
        sampler (or ``sampled`` when the caller decided)."""
        if parent is None:
            recording = self.sampler.sample_new() if sampled is None else sampled
            # An unsampled root makes no ids unless it is kept after all (``Span._ensure_ids``).
            trace_id = new_trace_id() if recording else ""
            parent_id = None
        else:
            trace_id = parent.trace_id
            parent_id = parent.span_id or None
            recording = parent.recording if isinstance(parent, Span) else parent.sampled
            if sampled is not None:
                recording = sampled
        return Span(
            self, trace_id, new_span_id() if recording else "", parent_id, name, component, instance_id,
            start_unix_ns or time.time_ns(), attributes if attributes is not None else {}, recording,
        )

    def start_root(self, name: str, component: str, attributes: dict[str, AttrValue]) -> Span:
        """``start_span`` of a new trace's root sampled by the sampler, for the frontend's
        per-request path (no parent to look at, no keyword handling)."""
        if self.sampler.sample_new():
            return Span(self, new_trace_id(), new_span_id(), None, name, component, None, time.time_ns(), attributes, True)
        # not sampled: no ids unless it is kept after all (``Span._ensure_ids``)
        return Span(self, "", "", None, name, component, None, time.time_ns(), attributes, False)

    def child(self, parent: Span | None, name: str, **attributes: AttrValue | None) -> Span | None:
        """A recording child of ``parent`` inheriting its component, instance and ids (and its
        ``request_id``, ``model``, ``worker_id`` and ``role`` attributes), or None when the parent
        is absent or not recording (the hot path pays one test)."""
        if parent is None or not parent.recording:
            return None
        inherited = parent.attributes
        attrs: dict[str, AttrValue] = {}
        for key in INHERITED_ATTRIBUTES:
            value = inherited.get(key)
            if value is not None:
                attrs[key] = value
        for key, value in attributes.items():  # None leaves an attribute out (or inherited)
            if value is not None:
                attrs[key] = value
        return Span(
            self, parent.trace_id, new_span_id(), parent.span_id, name, parent.component, parent.instance_id,
            time.time_ns(), attrs, True,
        )

    def record(self, span: Span) -> None:
        if not self.enabled:
            return
        self.ring.add(span)
        exporter = self.exporter
        if exporter is not None:
            try:
                exporter(span)
            except Exception:  # noqa: BLE001 - an exporter bug must not fail a request
                logger.exception("trace export failed span=%s", span.name)


_TRACER = Tracer()


def tracer() -> Tracer:
    """This process's tracer."""
    return _TRACER


# -- the current span (what outgoing request-plane streams carry) ---------------------------------------

_CURRENT: contextvars.ContextVar[Span | None] = contextvars.ContextVar("dynamod_current_span", default=None)


def current_span() -> Span | None:
    return _CURRENT.get()


class use_span:  # noqa: N801 - used like a function: ``with use_span(span):``
    """Makes ``span`` current for the request-plane streams opened inside the block (None: leaves
    things as they are). Use it around the call that opens a stream, inside a coroutine (not across
    an async generator's yield). A class, not ``contextlib.contextmanager``: it runs a few times per
    request on the frontend's hot path."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span | None) -> None:
        self._span = span
        self._token: contextvars.Token[Span | None] | None = None

    def __enter__(self) -> Span | None:
        if self._span is not None:
            self._token = _CURRENT.set(self._span)
        return self._span

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None


def outgoing_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` plus the current span's ``traceparent`` and ``x-request-id`` (the request-plane
    clients call this for every stream they open). Without a current span (tracing off) only the
    ``x-request-id`` of the request being served (the log lines' id) is added, so the workers'
    log lines still carry it."""
    span = _CURRENT.get()
    if span is None:
        rid = LOG_REQUEST_ID.get()
        if rid is None or (headers is not None and REQUEST_ID_HEADER in headers):
            return headers
        out = dict(headers) if headers else {}
        out[REQUEST_ID_HEADER] = rid
        return out
    if headers is not None and TRACEPARENT in headers:
        return headers
    out = dict(headers) if headers else {}
    if span.recording:
        if not span.span_id:
            span._ensure_ids()
        out[TRACEPARENT] = f"00-{span.trace_id}-{span.span_id}-01"  # format_traceparent, inlined
    elif span.span_id:
        out[TRACEPARENT] = format_traceparent(span.context)
    else:
        out[TRACEPARENT] = UNSAMPLED_TRACEPARENT  # nobody records it: its ids would never be seen
    rid = span.attributes.get("request_id")
    if rid is not None and REQUEST_ID_HEADER not in out:
        out[REQUEST_ID_HEADER] = str(rid)
    return out


def headers_context(headers: Mapping[str, str] | None) -> SpanContext | None:
    """The caller's span context from request-plane headers (None: none, or malformed)."""
    if not headers:
        return None
    value = headers.get(TRACEPARENT)
    if value == UNSAMPLED_TRACEPARENT:  # what every unsampled request carries: no parsing
        return UNSAMPLED
    return parse_traceparent(value)


def headers_request_id(headers: Mapping[str, str] | None) -> str | None:
    """The client-visible request id a caller passed along (``x-request-id``), when valid."""
    if not headers:
        return None
    value = headers.get(REQUEST_ID_HEADER)
    return value if value is not None and valid_request_id(value) else None


# -- engine hand-off ---------------------------------------------------------------------------------
# The engine interface is ``generate(request)``: a worker binds its request span to the engine
# request id, and the engine (mocker: queue/compute/transfer spans; vLLM: ``trace_headers``) looks
# it up once when the request starts. Only recording spans are bound, so the dict stays small.

_ENGINE_SPANS: dict[str, Span] = {}


def bind_engine_span(engine_request_id: str, span: Span) -> None:
    _ENGINE_SPANS[engine_request_id] = span


def unbind_engine_span(engine_request_id: str) -> None:
    _ENGINE_SPANS.pop(engine_request_id, None)


def engine_span(engine_request_id: str) -> Span | None:
    """The recording span of an engine request, or None."""
    return _ENGINE_SPANS.get(engine_request_id) if _ENGINE_SPANS else None


def trace_headers_for(engine_request_id: str) -> dict[str, str] | None:
    """``{"traceparent": ...}`` of an engine request's span, for engines that take W3C trace
    headers (vLLM's ``generate(trace_headers=...)``); None when it is not traced."""
    span = engine_span(engine_request_id)
    return None if span is None else {TRACEPARENT: format_traceparent(span.context)}


def flat_attributes(prefix: str, body: Mapping[str, Any]) -> dict[str, AttrValue]:
    """A JSON object as span attributes: its scalar values as ``prefix.key``, the rest (lists,
    nested objects) as compact JSON text, since span attributes are flat."""
    import json

    out: dict[str, AttrValue] = {}
    for key, value in body.items():
        if isinstance(value, str | int | float | bool):
            out[f"{prefix}.{key}"] = value
        elif value is not None:
            out[f"{prefix}.{key}"] = json.dumps(value, separators=(",", ":"))
    return out


def spans_as_dicts(spans: list[Span]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in spans]
