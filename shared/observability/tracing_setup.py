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
    TRACING_OFF,
    Sampler,
    SpanRing,
    Tracer,
    tracer,
)
from dynamod.shared.observability.tracing_otel import exporter_from_env


def parse_sample_rate(text: str) -> float | str:
    """A sample rate as written on a command line or in ``DYN_TRACE_SAMPLE_RATE``: a number from 0
    to 1, or ``off`` (``TRACING_OFF``); ``ValueError`` otherwise."""
    if text.strip().lower() == TRACING_OFF:
        return TRACING_OFF
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"a trace sample rate is a number from 0 to 1 or 'off', got {text!r}") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a trace sample rate is between 0 and 1 (or 'off'), got {text}")
    return rate


def configure(
    sample_rate: float | str | None = None, *, ring_requests: int | None = None, ring_spans: int | None = None,
    export: bool = True, service_name: str | None = None,
) -> Tracer:
    """Sets this process's sampling rate and ring bounds (None: ``DYN_TRACE_SAMPLE_RATE``,
    ``DYN_TRACE_RING_REQUESTS``, ``DYN_TRACE_RING_SPANS`` or the defaults) and, when ``export`` and
    the ``OTEL_*`` environment asks for it, attaches the OTLP exporter (``tracing_otel``). A rate of
    ``off`` switches tracing off (``Tracer.switch_off``; no exporter either). Called once by each
    role's main; safe to call again."""
    tracer_ = tracer()
    if sample_rate is None:
        env = os.environ.get("DYN_TRACE_SAMPLE_RATE")
        sample_rate = parse_sample_rate(env) if env else DEFAULT_SAMPLE_RATE
    elif isinstance(sample_rate, str):
        sample_rate = parse_sample_rate(sample_rate)
    if sample_rate == TRACING_OFF:
        tracer_.switch_off()
        tracer_.exporter = None
        return tracer_
    tracer_.enabled = True
    tracer_.sampler = Sampler(float(sample_rate))
    if ring_requests is None and os.environ.get("DYN_TRACE_RING_REQUESTS"):
        ring_requests = int(os.environ["DYN_TRACE_RING_REQUESTS"])
    if ring_spans is None and os.environ.get("DYN_TRACE_RING_SPANS"):
        ring_spans = int(os.environ["DYN_TRACE_RING_SPANS"])
    if ring_requests is not None or ring_spans is not None:
        tracer_.ring = SpanRing(ring_requests or DEFAULT_RING_REQUESTS, ring_spans or DEFAULT_RING_SPANS)
    if export and tracer_.exporter is None:
        tracer_.exporter = exporter_from_env(service_name)
    return tracer_


def configure_tracing(sample_rate: float | str | None) -> Tracer:
    """``configure`` for a role's command line: a bad rate (flag or ``DYN_TRACE_SAMPLE_RATE``) or
    OTLP setting is a ``ConfigError`` (one line, exit 1)."""
    try:
        return configure(sample_rate)
    except ValueError as exc:
        raise ConfigError(f"bad tracing setting: {exc}") from exc
