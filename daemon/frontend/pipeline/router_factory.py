"""Builds each model's router from ``--router-mode``.

Round-robin and random need nothing but the candidate list. The kv mode wraps the KV router of
``dynamod.daemon.router`` (one per model: block size and LoRA hashing are per model) and feeds it
the workers' KV events and load; it is imported only when chosen.

A disaggregated model's prefill pool gets its own router from ``build_prefill`` (kv: a KV router
over the prefill workers' events; otherwise a round-robin or random picker of its own).

Every model's router is wrapped for session affinity (``session_routing.py``) unless
``--router-session-affinity-ttl-secs 0``; prefill pools are not (the decode worker holds a
session's KV).
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from dynamod.daemon.frontend.pipeline.routing import Router, make_basic_router
from dynamod.daemon.frontend.pipeline.session_routing import (
    SessionAffinity,
    add_session_args,
    session_settings_from_args,
)
from dynamod.daemon.frontend.pipeline.worker_health import FRONTEND_COMPONENT, RoutingSync

if TYPE_CHECKING:
    from dynamod.daemon.frontend.pipeline.models import ModelRegistry, PrefillPool, ServedModel
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

def add_kv_router_args(parser: argparse.ArgumentParser) -> None:
    """The KV router's own flags (overlap weight, temperature, decision sampling) and session
    affinity's (every mode)."""
    from dynamod.daemon.router.core.config import add_router_args
    from dynamod.daemon.router.core.decision_publisher import add_decision_args

    add_router_args(parser)
    add_decision_args(parser)
    add_session_args(parser)


class RouterFactoryBuilder:
    """``build(model)`` is called by the model registry for every new model."""

    def __init__(self, mode: str, args: argparse.Namespace, runtime: DistributedRuntime, sync: RoutingSync) -> None:
        self.mode = mode
        self._kv = None
        ttl_s, max_sessions = session_settings_from_args(args)
        self.sessions = SessionAffinity(ttl_s, max_sessions, runtime, FRONTEND_COMPONENT)
        if mode == "kv":
            # Imported only when chosen: the other modes never load the KV router.
            from dynamod.daemon.frontend.pipeline.kv_routing import KvRouting

            self._kv = KvRouting(args, runtime, sync)
        else:
            make_basic_router(mode)  # validates the mode name now, not at the first model

    def attach(self, registry: ModelRegistry) -> None:
        """Lets the kv mode follow workers joining and leaving models."""
        if self._kv is not None:
            self._kv.attach(registry)

    async def start(self) -> None:
        if self._kv is not None:
            await self._kv.start()
        await self.sessions.start()

    async def close(self) -> None:
        await self.sessions.close()
        if self._kv is not None:
            await self._kv.close()

    def build(self, model: ServedModel) -> Router:
        router = self._kv.router_for(model) if self._kv is not None else make_basic_router(self.mode)
        return self.sessions.wrap(router, model)

    def build_prefill(self, pool: PrefillPool) -> Router:
        if self._kv is not None:
            return self._kv.prefill_router_for(pool)
        return make_basic_router(self.mode)
