"""The worker's part of disaggregated serving: the transfer flags and the transfer statistics
behind the load metrics and the Prometheus counters.

A worker of role ``prefill`` or ``decode`` whose engine keeps its own KV block memory (the mocker;
``KvTransferEngine`` in daemon/engines/base.py) gets a transfer agent over that memory, publishes the
agent's metadata in discovery before it serves ``generate``, and hands the engine a
``KvTransferContext`` (daemon/engines/kv_transfer.py) built from these settings, with
``KvTransferStats`` as its sink. Engines with their own connector (vLLM's NixlConnector, SGLang's
bootstrap) do not implement the protocol and move KV themselves.
"""

from __future__ import annotations

import argparse
import os
from collections import deque

from dynamod.daemon.engines.kv_transfer import (
    DEFAULT_HOLD_TIMEOUT_S,
    DEFAULT_OVERLAP,
    DEFAULT_TRANSFER_TIMEOUT_S,
    LIVE_OVERLAPS,
    KvTransferSettings,
)
from dynamod.daemon.worker.metrics import KvTransferMetrics
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.transfer.base import TransferResult
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.stats import percentiles

TRANSFER_BACKENDS = ("auto", "nixl", "tcp")
_WINDOW = 512  # transfers the p50/p99 figures are taken over


def add_kv_transfer_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--kv-transfer-backend", choices=TRANSFER_BACKENDS, default=os.environ.get("DYN_KV_TRANSFER_BACKEND", "auto"),
        help="how prefill/decode workers move KV blocks: nixl (UCX), tcp, or auto (nixl when installed) "
        "[env DYN_KV_TRANSFER_BACKEND, default auto]",
    )
    group.add_argument(
        "--kv-transfer-port", type=int, default=0,
        help="TCP port of the KV block server (worker i of --num-workers uses port+i; 0: any free port) [default 0]",
    )
    group.add_argument(
        "--kv-hold-timeout", type=float, default=DEFAULT_HOLD_TIMEOUT_S,
        help="prefill: seconds a computed prompt's KV blocks wait for the decode worker to read them "
        "[default %(default)s]",
    )
    group.add_argument(
        "--kv-transfer-overlap", choices=LIVE_OVERLAPS, default=os.environ.get("DYN_KV_TRANSFER_OVERLAP", DEFAULT_OVERLAP),
        help="prefill: chunk hands the decode worker a prompt's KV blocks as each prefill chunk computes them "
        "(transfer parameters at admission, decode starts when the last block lands); none: all of them after "
        "the prefill [env DYN_KV_TRANSFER_OVERLAP, default %(default)s]",
    )
    group.add_argument(
        "--kv-transfer-timeout", type=float, default=DEFAULT_TRANSFER_TIMEOUT_S,
        help="decode: seconds to read a prompt's KV blocks before prefilling locally instead [default %(default)s]",
    )


def kv_transfer_settings(
    args: argparse.Namespace,
    host: str,
    index: int = 0,
    *,
    advertise_host: str | None = None,
    security: RequestPlaneSecurity | None = None,
) -> KvTransferSettings:
    """Settings of worker ``index`` of this process; the agent binds the runtime's ``host``,
    advertises ``advertise_host`` and admits readers as the request plane does (``security``)."""
    for flag, value in (("--kv-hold-timeout", args.kv_hold_timeout), ("--kv-transfer-timeout", args.kv_transfer_timeout)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
    return KvTransferSettings(
        backend=args.kv_transfer_backend,
        host=host,
        port=args.kv_transfer_port + index if args.kv_transfer_port else 0,
        hold_timeout_s=args.kv_hold_timeout,
        transfer_timeout_s=args.kv_transfer_timeout,
        advertise_host=advertise_host,
        security=security,
        overlap=getattr(args, "kv_transfer_overlap", DEFAULT_OVERLAP),
    )


class KvTransferStats:
    """Cumulative transfer figures of one worker, a bounded window of transfer times, and the
    Prometheus series they feed. A decode worker counts what it pulled; a prefill worker counts
    as served the blocks a decode worker's notification released."""

    def __init__(self, worker_id: int, backend: str, metrics: KvTransferMetrics | None = None) -> None:
        self.worker_id = worker_id
        self.backend = backend
        self._metrics = metrics
        self._wid = worker_id_hex(worker_id)
        self.bytes_total = 0
        self.transfers = 0
        self.failures = 0
        self.failures_by_reason: dict[str, int] = {}
        self.holds_expired = 0
        self.held_blocks = 0
        self._ms: deque[float] = deque(maxlen=_WINDOW)
        self._exposed_ms: deque[float] = deque(maxlen=_WINDOW)

    def pulled(self, result: TransferResult) -> None:
        self.bytes_total += result.num_bytes
        self.transfers += 1
        self._ms.append(result.seconds * 1000.0)
        if self._metrics is not None:
            self._metrics.pulled(self._wid, result)

    def exposed(self, ms: float, streamed: bool) -> None:
        """A decode worker's KV arrived ``ms`` after the prefill computed its last block (the
        transfer time the first token waits for; ``streamed``: overlapped with the prefill)."""
        self._exposed_ms.append(ms)
        if self._metrics is not None:
            self._metrics.exposed(self._wid, ms, streamed)

    def exposed_percentiles_ms(self) -> tuple[float, float]:
        """(p50, p99) of the exposed transfer times in the window; zeros before the first."""
        p50, p99 = percentiles(self._exposed_ms, (0.5, 0.99))
        return p50, p99

    def served(self, num_blocks: int, num_bytes: int) -> None:
        self.bytes_total += num_bytes
        self.transfers += 1
        if self._metrics is not None:
            self._metrics.served(self._wid, self.backend, num_blocks, num_bytes)

    def failed(self, reason: str) -> None:
        self.failures += 1
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1
        if self._metrics is not None:
            self._metrics.failed(self._wid, reason)

    def hold_expired(self) -> None:
        self.holds_expired += 1
        if self._metrics is not None:
            self._metrics.hold_expired(self._wid)

    def set_held_blocks(self, n: int) -> None:
        self.held_blocks = n
        if self._metrics is not None:
            self._metrics.held(self._wid, n)

    def percentiles_ms(self) -> tuple[float, float]:
        """(p50, p99) of the transfer times in the window; zeros before the first transfer."""
        p50, p99 = percentiles(self._ms, (0.5, 0.99))
        return p50, p99
