"""What every endpoint of one frontend process shares: settings, models, dispatch, metrics, and
the admission state that graceful shutdown flips."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from dynamod.daemon.frontend.dispatch import Dispatcher
from dynamod.daemon.frontend.metrics import FrontendMetrics
from dynamod.daemon.frontend.models import ModelRegistry


@dataclass(slots=True)
class FrontendConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    router_mode: str = "round-robin"
    migration_limit: int = 3
    worker_wait_s: float = 5.0
    max_inflight: int = 4096
    coalesce_s: float = 0.0
    shutdown_grace_s: float = 30.0
    num_frontends: int = 1


@dataclass(eq=False)
class FrontendState:
    config: FrontendConfig
    registry: ModelRegistry
    dispatcher: Dispatcher
    metrics: FrontendMetrics
    draining: bool = False
    inflight: int = 0
    pid: int = field(default_factory=os.getpid)
    frontend_pids: list[int] = field(default_factory=list)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def admit(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no admitted request is left; False if ``timeout_s`` passed first."""
        if self.inflight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
