"""Sets up this process's tracer from its command line and environment: the sampling rate, the
ring buffer's bounds and, when the ``OTEL_*`` environment asks for it, the OTLP exporter.

Its own module because it joins the two others: ``tracing`` (spans and the ring, no SDK) and
``tracing_otel`` (the exporter, which imports ``tracing``'s span types).
"""

from __future__ import annotations

import os

from dynamod.shared.errors import ConfigError
from dynamod.shared.observability.tracing import (
    DEFAULT_RING_REQUESTS,
    DEFAULT_RING_SPANS,
    DEFAULT_SAMPLE_RATE,
    Sampler,
    SpanRing,
    Tracer,
    tracer,
)
from dynamod.shared.observability.tracing_otel import exporter_from_env


def configure(
    sample_rate: float | None = None, *, ring_requests: int | None = None, ring_spans: int | None = None,
    export: bool = True, service_name: str | None = None,
) -> Tracer:
    """Sets this process's sampling rate and ring bounds (None: ``DYN_TRACE_SAMPLE_RATE``,
    ``DYN_TRACE_RING_REQUESTS``, ``DYN_TRACE_RING_SPANS`` or the defaults) and, when ``export`` and the ``OTEL_*`` environment asks for it, attaches the OTLP
    exporter (``tracing_otel``). Called once by each role's main; safe to call again."""
    tracer_ = tracer()
    if sample_rate is None:
        env = os.environ.get("DYN_TRACE_SAMPLE_RATE")
        sample_rate = float(env) if env else DEFAULT_SAMPLE_RATE
    tracer_.sampler = Sampler(sample_rate)
    if ring_requests is None and os.environ.get("DYN_TRACE_RING_REQUESTS"):
        ring_requests = int(os.environ["DYN_TRACE_RING_REQUESTS"])
    if ring_spans is None and os.environ.get("DYN_TRACE_RING_SPANS"):
        ring_spans = int(os.environ["DYN_TRACE_RING_SPANS"])
    if ring_requests is not None or ring_spans is not None:
        tracer_.ring = SpanRing(ring_requests or DEFAULT_RING_REQUESTS, ring_spans or DEFAULT_RING_SPANS)
    if export and tracer_.exporter is None:
        tracer_.exporter = exporter_from_env(service_name)
    return tracer_


def configure_tracing(sample_rate: float | None) -> Tracer:
    """``configure`` for a role's command line: a bad rate (flag or ``DYN_TRACE_SAMPLE_RATE``) or
    OTLP setting is a ``ConfigError`` (one line, exit 1)."""
    try:
        return configure(sample_rate)
    except ValueError as exc:
        raise ConfigError(f"bad tracing setting: {exc}") from exc
