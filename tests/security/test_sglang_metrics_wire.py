"""SGLang's pickled load reports are read without executing anything (issue 25, item 12).

The pickles are made the way SGLang's scheduler makes them (``send_pyobj`` of a ``KvMetrics``
object from an ``sglang.`` module) and sent over a real ZMQ PUSH/PULL pair on an ipc socket;
hostile pickles (a ``__reduce__`` to ``os.system``, ``builtins.eval``, an oversized message) are
refused and run nothing.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path

import pytest
import zmq

from dynamod.daemon.engines.sglang.metrics_wire import (
    MAX_PAYLOAD_BYTES,
    MetricsMessageError,
    decode_kv_metrics,
)


@pytest.fixture
def sglang_kv_metrics():
    """A ``KvMetrics`` class living where SGLang keeps it, so pickle names it the same way."""
    name = "sglang.srt.managers.scheduler_metrics_mixin"
    module = types.ModuleType(name)

    class KvMetrics:
        def __init__(self) -> None:
            self.request_active_slots = 3
            self.request_total_slots = 64
            self.kv_active_blocks = 120
            self.kv_total_blocks = 1000
            self.num_requests_waiting = 2
            self.gpu_cache_usage_perc = 0.12
            self.gpu_prefix_cache_hit_rate = 0.5
            self.data_parallel_rank = 1

    KvMetrics.__module__ = name
    KvMetrics.__qualname__ = "KvMetrics"
    module.KvMetrics = KvMetrics
    parts = name.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        dotted = ".".join(parts[:i])
        if dotted not in sys.modules:
            sys.modules[dotted] = module if dotted == name else types.ModuleType(dotted)
            added.append(dotted)
    yield KvMetrics
    for dotted in added:
        del sys.modules[dotted]


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _roundtrip(payloads: list[bytes], tmp_path: Path) -> list[bytes]:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        address = f"ipc://{tmp_path}/metrics.ipc"
        pull.bind(address)
        push.connect(address)
        for p in payloads:
            push.send(p)
        return [pull.recv() for _ in payloads]
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_a_genuine_report_is_read_and_hostile_ones_run_nothing(sglang_kv_metrics, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    genuine = pickle.dumps(sglang_kv_metrics(), protocol=pickle.DEFAULT_PROTOCOL)
    hostile = [
        pickle.dumps(_Evil(marker)),
        pickle.dumps(eval),  # a global other than KvMetrics
        pickle.dumps({"kv_active_blocks": 1}),  # not a report at all
        b"\x80\x04not a pickle",
    ]
    received = _roundtrip([genuine, *hostile], tmp_path)
    m = decode_kv_metrics(received[0])
    assert (m.kv_active_blocks, m.kv_total_blocks, m.data_parallel_rank, m.gpu_prefix_cache_hit_rate) == (120, 1000, 1, 0.5)
    for payload in received[1:]:
        with pytest.raises(MetricsMessageError):
            decode_kv_metrics(payload)
    assert not marker.exists()
    with pytest.raises(MetricsMessageError, match="over"):
        decode_kv_metrics(b"x" * (MAX_PAYLOAD_BYTES + 1))


def test_a_report_with_non_numeric_fields_is_refused(sglang_kv_metrics) -> None:
    report = sglang_kv_metrics()
    report.kv_active_blocks = ["a", "list"]
    with pytest.raises(MetricsMessageError, match="non-numeric"):
        decode_kv_metrics(pickle.dumps(report))
