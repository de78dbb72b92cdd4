"""What every endpoint of one frontend process shares: settings, models, dispatch, metrics, and
the admission state that graceful shutdown flips."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dynamod.daemon.frontend.http.fleet_metrics import FleetMetrics
from dynamod.daemon.frontend.http.request_checks import REASON_DRAINING, REASON_OVERLOADED
from dynamod.daemon.frontend.pipeline.dispatch import Dispatcher
from dynamod.daemon.frontend.pipeline.encode import EncodeStage
from dynamod.daemon.frontend.pipeline.metrics import FrontendMetrics
from dynamod.daemon.frontend.pipeline.models import ModelRegistry
from dynamod.daemon.frontend.preprocess.media import MediaLoader, MediaSettings
from dynamod.shared.drain import InFlight
from dynamod.shared.errors import DynamoError, OverloadedError, UnavailableError

# Why a request is turned away before its body is read (also the refusal metric's reason label).
REFUSED_DRAINING = REASON_DRAINING
REFUSED_OVERLOADED = REASON_OVERLOADED


@dataclass(slots=True)
class FrontendConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    router_mode: str = "round-robin"
    migration_limit: int = 3
    worker_wait_s: float = 5.0
    max_inflight: int = 4096  # generations in flight: a fan-out request counts each of its choices
    max_prompts_per_request: int = 128  # prompts x n of one request (fanout.check_fanout)
    coalesce_s: float = 0.0
    shutdown_grace_s: float = 30.0
    num_frontends: int = 1
    responses_store_size: int = 1024  # responses kept for previous_response_id (0: none)
    media: MediaSettings = field(default_factory=MediaSettings)  # image limits (--allowed-media-domains, ...)


@dataclass(eq=False)
class FrontendState:
    config: FrontendConfig
    registry: ModelRegistry
    dispatcher: Dispatcher
    metrics: FrontendMetrics
    draining: bool = False
    pid: int = field(default_factory=os.getpid)
    frontend_pids: list[int] = field(default_factory=list)
    fleet_metrics: FleetMetrics | None = None  # a --num-frontends member: /metrics adds up the fleet
    _inflight: InFlight = field(default_factory=InFlight)
    media: MediaLoader | None = None  # images of chat requests; made from ``config.media`` when not given

    def __post_init__(self) -> None:
        if self.media is None:
            self.media = MediaLoader(self.config.media)
        if self.dispatcher is not None and self.dispatcher.encode_stage is None:  # images to the encode pools
            self.dispatcher.encode_stage = EncodeStage(self.registry, self.dispatcher.quarantine)

    @property
    def inflight(self) -> int:
        """Generations admitted and not yet released."""
        return self._inflight.count

    def admission_refusal(self, cost: int = 1) -> tuple[str, DynamoError] | None:
        """Why a new request of ``cost`` generations (prompts x n) may not be admitted now (reason,
        error), or None: the one rule the front doors (before the body is read, cost 1) and the
        endpoints (after it, the real cost) both apply."""
        if self.draining:
            return REFUSED_DRAINING, UnavailableError("the frontend is shutting down; retry on another frontend")
        if self.inflight + cost > self.config.max_inflight:
            return REFUSED_OVERLOADED, OverloadedError(
                f"the frontend has {self.inflight} generations in flight (limit {self.config.max_inflight}); "
                f"this request needs {cost}",
                retry_after_s=1.0,
            )
        return None

    def admit(self, cost: int = 1) -> None:
        self._inflight.enter(cost)

    def release(self, cost: int = 1) -> None:
        self._inflight.leave(cost)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no admitted request is left; False if ``timeout_s`` passed first."""
        return await self._inflight.wait_idle(timeout_s)
