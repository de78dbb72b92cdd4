"""What an engine that moves KV blocks itself is handed: the ``KvTransferContext``.

A prefill or decode worker whose engine keeps its own KV block memory (the mocker;
``KvTransferEngine`` in base.py) builds a transfer agent over that memory, publishes the agent in
discovery, and hands the engine this context: the agent, the directory to find peers in, the
deadlines and a sink for the transfer figures. The worker (daemon/worker/kv_transfer.py) makes it
from its flags and counts the figures into its metrics; engines see only the shapes here, so an
engine never imports the worker that hosts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dynamod.shared.kv.transfer.base import KvTransferAgent, TransferResult
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata
from dynamod.shared.security.settings import RequestPlaneSecurity

DEFAULT_HOLD_TIMEOUT_S = 60.0
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
# When a prefill worker hands a prompt's KV to the decode worker (``--kv-transfer-overlap``).
OVERLAP_CHUNK = "chunk"  # transfer parameters at admission; each chunk's blocks are read as computed
OVERLAP_NONE = "none"  # transfer parameters when the prefill ends; then all blocks are read
LIVE_OVERLAPS = (OVERLAP_CHUNK, OVERLAP_NONE)
DEFAULT_OVERLAP = OVERLAP_CHUNK

# Failure reasons (dynamo_component_kv_transfer_failures_total{reason}).
REASON_TIMEOUT = "timeout"
REASON_PEER_LOST = "peer_lost"  # no agent record, connection refused or broken
REASON_CHECKSUM = "checksum"
REASON_ERROR = "error"  # anything else: layout mismatch, a refusal, a bug


@dataclass(frozen=True, slots=True)
class KvTransferSettings:
    """``--kv-transfer-*`` and ``--kv-hold-timeout``: how a prefill/decode worker moves KV."""

    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    peer_component: str = "prefill"  # where decode workers look prefill workers' agents up
    advertise_host: str | None = None  # what the agent's metadata names instead of ``host``
    security: RequestPlaneSecurity | None = None  # the request plane's TLS and token guard the block server too
    overlap: str = DEFAULT_OVERLAP  # prefill: LIVE_OVERLAPS (a decode worker reads either kind)


class TransferDirectory(Protocol):
    """What an engine needs of ``KvTransferDirectory``: finding a peer's agent."""

    async def lookup(self, worker_id: int, component: str = "prefill", *, timeout_s: float = 5.0) -> KvTransferMetadata: ...


class TransferStatsSink(Protocol):
    """Where an engine reports its transfers (the worker's ``KvTransferStats``)."""

    def pulled(self, result: TransferResult) -> None: ...

    def served(self, num_blocks: int, num_bytes: int) -> None: ...

    def failed(self, reason: str) -> None: ...

    def exposed(self, ms: float, streamed: bool) -> None: ...

    def hold_expired(self) -> None: ...

    def set_held_blocks(self, n: int) -> None: ...


@dataclass(slots=True)
class KvTransferContext:
    """What a ``KvTransferEngine`` is handed once its agent serves and is published."""

    agent: KvTransferAgent
    directory: TransferDirectory
    stats: TransferStatsSink
    settings: KvTransferSettings
