"""OTLP export: the spans the ring holds reach an OTLP gRPC receiver with the same ids, parents,
names and attributes; the ``OTEL_*`` environment decides whether, how and what share is exported."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynamod.shared.observability import tracing, tracing_otel
from dynamod.shared.observability.tracing import Sampler, Tracer
from tests.unit.observability.otlp_receiver import OtlpReceiver

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")

_OTEL_VARS = (
    "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORT_ENABLED", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME",
)


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    try:
        yield r
    finally:
        r.stop()


def test_env_decides_export(clean_otel_env: pytest.MonkeyPatch) -> None:
    env = clean_otel_env
    assert not tracing_otel.export_requested()
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert tracing_otel.export_requested()
    env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing_otel.export_requested()
    env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    env.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing_otel.export_requested()
    env.delenv("OTEL_SDK_DISABLED")
    assert tracing_otel.export_protocol() == "grpc"
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert tracing_otel.export_protocol() == "http/protobuf"
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="not supported"):
        tracing_otel.export_protocol()
    assert tracing_otel.export_sampler().rate == 1.0
    env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    assert tracing_otel.export_sampler().rate == pytest.approx(0.1)
    # The HTTP exporter is built when asked for (it reads its endpoint from the same environment).
    env.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    assert isinstance(tracing_otel.exporter_from_env(), tracing_otel.OtlpSpanSink)


def _tree(tr: Tracer) -> list[tracing.Span]:
    root = tr.start_span(
        "http-request", component="frontend", sampled=True,
        attributes={"request_id": "otlp-1", "model": "tiny", "stream": True, "duration_ms": 12.5},
    )
    route = tr.child(root, "route", worker_id="1a2b")
    assert route is not None
    route.end()
    worker = tr.start_span(
        "handle_payload", component="decode", parent=route.context, instance_id="1a2b",
        attributes={"request_id": "otlp-1", "model": "tiny", "worker_id": "1a2b", "role": "decode"},
    )
    worker.fail(RuntimeError("engine failed"))
    worker.end()
    root.end()
    return [root, route, worker]


def test_grpc_receiver_gets_the_same_spans(clean_otel_env: pytest.MonkeyPatch, receiver: OtlpReceiver) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")
    sink = tracing_otel.exporter_from_env()
    assert isinstance(sink, tracing_otel.OtlpSpanSink)
    tr = Tracer()
    tr.exporter = sink
    try:
        spans = _tree(tr)
        assert sink.force_flush(10_000)
        got = {s.span_id: s for s in receiver.wait_for(lambda r: len(r) >= 3)}
    finally:
        sink.shutdown()
    held = {s.span_id: s for s in tr.ring.find("otlp-1")}
    assert set(got) == set(held) == {s.span_id for s in spans}
    for span_id, mine in held.items():
        theirs = got[span_id]
        assert (theirs.trace_id, theirs.parent_id, theirs.name) == (mine.trace_id, mine.parent_id, mine.name)
        assert (theirs.start_unix_ns, theirs.end_unix_ns) == (mine.start_unix_ns, mine.end_unix_ns)
        assert theirs.service == f"dynamod-{mine.component}"
        for key, value in mine.attributes.items():
            assert theirs.attributes[key] == value
    worker = next(s for s in spans if s.name == "handle_payload")
    assert got[worker.span_id].status_code == 2  # STATUS_CODE_ERROR
    assert got[worker.span_id].attributes["dynamo.instance_id"] == "1a2b"


def test_export_ratio_keeps_errors_and_migrations(clean_otel_env: pytest.MonkeyPatch) -> None:
    exported: list[str] = []

    class Collect:
        def on_end(self, span: object) -> None:
            exported.append(span.name)  # type: ignore[attr-defined]

    sink = tracing_otel.OtlpSpanSink.__new__(tracing_otel.OtlpSpanSink)
    sink.processor = Collect()
    sink.service_name = None
    sink.sampler = Sampler(0.0)
    sink._resources = {}
    tr = Tracer()
    tr.exporter = sink
    ok = tr.start_span("plain", component="frontend", sampled=True, attributes={"request_id": "a"})
    ok.end()
    bad = tr.start_span("failed", component="frontend", sampled=True, attributes={"request_id": "b"})
    bad.fail("x")
    bad.end()
    moved = tr.start_span("migration", component="frontend", sampled=True, attributes={"request_id": "c", "migrated": True})
    moved.end()
    assert exported == ["failed", "migration"]
    assert len(tr.ring) == 3  # the ring keeps what export leaves out
