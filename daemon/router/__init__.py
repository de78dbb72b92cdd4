"""The KV-aware router: picks the worker whose cache and load make a request cheapest.

``KvRouter`` (kv_router.py) is the facade the frontend and the standalone router call; the pieces
are the KV index (shared/kv/), active sequences, busy detection, the scheduler and the wait queue.
"""

from dynamod.daemon.router.config import KvRouterConfig, add_router_args, config_from_args
from dynamod.daemon.router.kv_router import KvRouter
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
