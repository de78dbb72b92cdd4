"""An in-process OTLP trace receiver for tests (no tests here): a gRPC server built from the
opentelemetry-proto package's ``TraceService`` definition that keeps every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_pb2_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    attributes: dict[str, Any]
    start_unix_ns: int
    end_unix_ns: int
    status_code: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    port: int = 0
    _server: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> OtlpReceiver:
        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc,name-defined]
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method's name
                receiver._take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def _take(self, request: Any) -> None:
        out = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(ReceivedSpan(
                        service=service, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None, name=s.name,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        start_unix_ns=s.start_time_unix_nano, end_unix_ns=s.end_time_unix_nano,
                        status_code=s.status.code,
                    ))
        with self._lock:
            self.spans.extend(out)

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while True:
            spans = self.received()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"OTLP receiver: condition not met in {timeout}s; got {len(spans)} spans")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)
