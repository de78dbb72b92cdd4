"""Chooses a ``KvTransferAgent`` by name: ``nixl``, ``tcp``, or ``auto`` (NIXL when it imports and
an agent initialises on this host, our TCP transport otherwise), so ``dynamod up`` needs nothing
beyond the base install and a node with ``dynamod[nixl]`` uses NIXL without a flag.
"""

from __future__ import annotations

import functools
import logging
import uuid

from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.nixl import NixlKvAgent, load_nixl_api
from dynamod.shared.kv.transfer.tcp import TcpKvAgent
from dynamod.shared.protocol.kv_transfer import BACKEND_NIXL, BACKEND_TCP, KvLayout
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.transport.liveness import RequestPlaneMetrics

logger = logging.getLogger(__name__)

AGENT_BACKENDS = ("auto", BACKEND_NIXL, BACKEND_TCP)


@functools.cache
def nixl_unavailable_reason() -> str | None:
    """None when NIXL imports and a UCX agent initialises here; otherwise why not (checked once
    per process: creating a probe agent costs about a second)."""
    try:
        api = load_nixl_api()
    except ImportError as exc:
        return str(exc)
    try:
        probe = api.nixl_agent(f"probe-{uuid.uuid4().hex[:12]}", api.nixl_agent_config(backends=["UCX"]))
    except Exception as exc:
        return f"NIXL agent does not initialise: {type(exc).__name__}: {exc}"
    if "UCX" not in probe.backends:
        return f"NIXL has no UCX backend (plugins: {probe.get_plugin_list()})"
    return None


def nixl_available() -> bool:
    return nixl_unavailable_reason() is None


def create_agent(
    memory: KvBlockMemory,
    *,
    worker_id: int,
    backend: str = "auto",
    host: str = "127.0.0.1",
    port: int = 0,
    layout: KvLayout | None = None,
    advertise_host: str | None = None,
    security: RequestPlaneSecurity | None = None,
    metrics: RequestPlaneMetrics | None = None,
) -> KvTransferAgent:
    """An un-started agent over ``memory`` (call ``await agent.start()``). ``port`` is the TCP
    block server's (every agent runs one; 0 = any free port); ``advertise_host`` what its metadata
    names instead of ``host``; ``security`` the request plane's TLS and cluster token, which the
    block server demands and the reader presents; ``metrics`` counts refused readers."""
    name = (backend or "").strip().lower()
    if name not in AGENT_BACKENDS:
        raise ConfigError(f"unknown KV transfer backend {backend!r}; valid: {', '.join(AGENT_BACKENDS)}")
    if name == "auto":
        reason = nixl_unavailable_reason()
        name = BACKEND_NIXL if reason is None else BACKEND_TCP
        logger.info(
            "kv_transfer.backend_chosen worker_id=%016x backend=%s requested=auto reason=%r",
            worker_id,
            name,
            reason or "nixl available",
        )
    elif name == BACKEND_NIXL:
        reason = nixl_unavailable_reason()
        if reason is not None:
            raise ConfigError(f"KV transfer backend 'nixl' is not usable here: {reason}; use 'tcp' or 'auto'")
    if name == BACKEND_NIXL:
        return NixlKvAgent(
            memory, worker_id=worker_id, host=host, port=port, layout=layout,
            advertise_host=advertise_host, security=security, metrics=metrics,
        )
    return TcpKvAgent(
        memory, worker_id=worker_id, host=host, port=port, layout=layout,
        advertise_host=advertise_host, security=security, metrics=metrics,
    )
