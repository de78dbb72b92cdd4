"""OTLP export of our spans through the OpenTelemetry SDK (the optional ``trace`` extra).

Configured only by the standard ``OTEL_*`` environment, read by the SDK itself where it can:

- on when ``OTEL_TRACES_EXPORTER`` names ``otlp``, or an endpoint is set
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``), or Dynamo's
  ``OTEL_EXPORT_ENABLED=1``; off with ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``;
- protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``grpc``
  (default) or ``http/protobuf``; endpoint, headers, timeout, compression and certificates as the
  SDK's exporters read them; batching as ``BatchSpanProcessor`` reads ``OTEL_BSP_*``;
- ``service.name``: ``OTEL_SERVICE_NAME``, else ``dynamod-<component>`` per span's component;
  ``OTEL_RESOURCE_ATTRIBUTES`` is added;
- export sampling on top of the recording rate (``--trace-sample-rate``):
  ``OTEL_TRACES_SAMPLER=traceidratio`` (or ``parentbased_traceidratio``) with
  ``OTEL_TRACES_SAMPLER_ARG``, decided from the trace id (every process agrees); spans in error and
  spans of migrated requests are always exported.

Our spans are recorded by ``tracing.Tracer`` (the ring buffer works without this module); here an
ended span becomes an SDK ``ReadableSpan`` and goes to a ``BatchSpanProcessor``, whose thread does
the network I/O, so the event loop never waits on the collector.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from dynamod.shared.observability.tracing import STATUS_ERROR, Sampler, Span, SpanSink

logger = logging.getLogger(__name__)

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def export_requested() -> bool:
    """Whether the ``OTEL_*`` environment asks for trace export."""
    if _truthy("OTEL_SDK_DISABLED"):
        return False
    exporters = {e.strip().lower() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        return False
    return (
        "otlp" in exporters
        or bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        or _truthy("OTEL_EXPORT_ENABLED")
    )


def export_protocol() -> str:
    proto = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or PROTOCOL_GRPC
    ).strip().lower()
    if proto not in (PROTOCOL_GRPC, PROTOCOL_HTTP):
        raise ValueError(f"OTLP trace protocol {proto!r} is not supported; use {PROTOCOL_GRPC} or {PROTOCOL_HTTP}")
    return proto


def export_sampler() -> Sampler:
    """The export ratio from ``OTEL_TRACES_SAMPLER``/``_ARG`` (1.0 unless a ratio sampler is named)."""
    name = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if name in ("always_off", "parentbased_always_off"):
        return Sampler(0.0)
    if name in ("traceidratio", "parentbased_traceidratio"):
        arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            return Sampler(min(1.0, max(0.0, float(arg))))
        except ValueError:
            logger.warning("trace export sampler arg is not a number value=%r action=export_all", arg)
    return Sampler(1.0)


class OtlpSpanSink:
    """Converts our ended spans to SDK spans and hands them to a batch processor."""

    def __init__(self, span_exporter: Any, *, service_name: str | None = None, sampler: Sampler | None = None) -> None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.processor = BatchSpanProcessor(span_exporter)
        self.service_name = service_name or os.environ.get("OTEL_SERVICE_NAME") or None
        self.sampler = sampler or Sampler(1.0)
        self._resources: dict[str, Any] = {}

    def _resource(self, component: str) -> Any:
        resource = self._resources.get(component)
        if resource is None:
            from opentelemetry.sdk.resources import Resource

            attrs = {"service.name": self.service_name or f"dynamod-{component}", "dynamo.component": component}
            resource = self._resources[component] = Resource.create(attrs)
        return resource

    def __call__(self, span: Span) -> None:
        if (
            span.status != STATUS_ERROR
            and not span.attributes.get("migrated")
            and not self.sampler.sampled(span.trace_id)
        ):
            return
        self.processor.on_end(self.to_readable(span))

    def to_readable(self, span: Span) -> Any:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode

        trace_id = int(span.trace_id, 16)
        ctx = SpanContext(trace_id, int(span.span_id, 16), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        parent = (
            None if span.parent_id is None
            else SpanContext(trace_id, int(span.parent_id, 16), is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        )
        attrs = dict(span.attributes)
        attrs["dynamo.component"] = span.component
        if span.instance_id is not None:
            attrs["dynamo.instance_id"] = span.instance_id
        if span.status == STATUS_ERROR:
            status = Status(StatusCode.ERROR, str(span.attributes.get("error", "")))
        else:
            status = Status(StatusCode.OK)
        kind = SpanKind.SERVER if span.parent_id is None or span.name == "handle_payload" else SpanKind.INTERNAL
        if span.name in ("client_request", "prefill"):
            kind = SpanKind.CLIENT
        return ReadableSpan(
            span.name, context=ctx, parent=parent, resource=self._resource(span.component), attributes=attrs,
            kind=kind, status=status, start_time=span.start_unix_ns, end_time=span.end_unix_ns,
        )

    def force_flush(self, timeout_ms: int = 30_000) -> bool:
        return bool(self.processor.force_flush(timeout_ms))

    def shutdown(self) -> None:
        self.processor.shutdown()


def make_span_exporter(protocol: str) -> Any:
    """The SDK's OTLP span exporter for ``protocol``; it reads its ``OTEL_EXPORTER_OTLP_*`` settings."""
    if protocol == PROTOCOL_HTTP:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter()


def exporter_from_env(service_name: str | None = None) -> SpanSink | None:
    """The OTLP sink the environment asks for, or None (not asked, or the ``trace`` extra is not
    installed: a warning says so once and the ring buffer keeps working)."""
    if not export_requested():
        return None
    protocol = export_protocol()
    try:
        span_exporter = make_span_exporter(protocol)
        sink = OtlpSpanSink(span_exporter, service_name=service_name, sampler=export_sampler())
    except ImportError as exc:
        logger.warning(
            "trace export requested but OpenTelemetry is not installed error=%s action=ring_only "
            "hint='pip install dynamod[trace]'", exc,
        )
        return None
    # The batch still queued at exit goes out (the SDK's TracerProvider does the same).
    atexit.register(sink.shutdown)
    logger.info("trace export on protocol=%s sample_ratio=%g", protocol, sink.sampler.rate)
    return sink
