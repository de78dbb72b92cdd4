"""SGLang's scheduler load reports, read without running anything the sender chose.

SGLang's schedulers push a ``KvMetrics`` object with ``send_pyobj`` (a pickle) to
``port_args.metrics_ipc_name``. ``recv_pyobj`` would unpickle whatever arrives, and unpickling
can call any importable function: whoever can write to that socket runs code in the worker. We
cannot change the sender, so the reader accepts only the pickle of a plain ``KvMetrics`` object:

- ``find_class`` resolves exactly one name, ``KvMetrics`` from a ``sglang.`` module, and resolves it
  to an inert local stand-in (nothing is imported); every other global is refused, so no callable
  is ever reachable (``REDUCE`` has nothing to call, ``NEWOBJ`` builds the stand-in only);
- the object's attributes are copied into ``SglangKvMetrics`` (known numeric fields only, numbers
  or None; anything else is refused);
- payloads over ``MAX_PAYLOAD_BYTES`` are refused before unpickling (the socket also caps them).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import msgspec

MAX_PAYLOAD_BYTES = 16 * 1024
_FIELDS = (
    "request_active_slots", "request_total_slots", "kv_active_blocks", "kv_total_blocks",
    "num_requests_waiting", "gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate", "data_parallel_rank",
)


class SglangKvMetrics(msgspec.Struct):
    """The numbers of one scheduler report (SGLang's ``KvMetrics`` attribute names)."""

    request_active_slots: int | float | None = None
    request_total_slots: int | float | None = None
    kv_active_blocks: int | float | None = None
    kv_total_blocks: int | float | None = None
    num_requests_waiting: int | float | None = None
    gpu_cache_usage_perc: int | float | None = None
    gpu_prefix_cache_hit_rate: int | float | None = None
    data_parallel_rank: int | None = None


class _KvMetricsStandIn:
    """What the pickle's ``KvMetrics`` becomes: a bare object whose ``__dict__`` BUILD fills."""


class _MetricsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name == "KvMetrics" and module.startswith("sglang."):
            return _KvMetricsStandIn
        raise pickle.UnpicklingError(f"refused global {module}.{name} in an SGLang metrics message")


class MetricsMessageError(ValueError):
    """A message on the metrics socket that is not a plain ``KvMetrics`` report."""


def decode_kv_metrics(payload: bytes) -> SglangKvMetrics:
    """One scheduler report, or ``MetricsMessageError`` (module docstring)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MetricsMessageError(f"metrics message of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    try:
        obj = _MetricsUnpickler(io.BytesIO(payload)).load()
    except Exception as exc:  # noqa: BLE001 - any malformed or hostile pickle is one refusal
        raise MetricsMessageError(f"not a KvMetrics report: {exc}") from None
    if type(obj) is not _KvMetricsStandIn:
        raise MetricsMessageError(f"not a KvMetrics report: a {type(obj).__name__}")
    fields = {k: v for k, v in vars(obj).items() if k in _FIELDS}
    try:
        return msgspec.convert(fields, SglangKvMetrics)
    except msgspec.ValidationError as exc:
        raise MetricsMessageError(f"KvMetrics report with a non-numeric field: {exc}") from None
