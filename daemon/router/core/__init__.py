"""The KV router's core as a library: scoring and picking workers, the active sequences they hold,
busy checks and the wait queue, the disaggregation decision and the prefill stage.

Two roles embed it: the frontend (routing in-process) and the standalone router
(``dynamod --role router``, daemon/router/service.py). Neither imports the other; both import this.
Its compiled twin of the scheduler loops (``_schedcore``, _native/schedcore.c) sits beside it.
"""

from dynamod.daemon.router.core.config import KvRouterConfig, add_router_args, config_from_args
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.shared.protocol.routing import HEADER_NAME, CandidateScore, RoutingDecision

__all__ = [
    "HEADER_NAME",
    "CandidateScore",
    "KvRouter",
    "KvRouterConfig",
    "RoutingDecision",
    "add_router_args",
    "config_from_args",
]
