"""What the disaggregation policy reads of a worker's load, from a ``KvRouter``'s view of it.

One helper for both live callers (the frontend's KV routing and the router role): the worker's
own load metrics while they are fresh (only the engine knows its real queue), else the router's
own counts of the requests it routed there. The router's count is also the floor: requests it
routed a moment ago are not in the worker's last report yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.daemon.router.core import local_choice
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.shared.protocol.routing import RoutingDecision


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """The chosen decode worker as the policy sees it (tokens unless named otherwise)."""

    cached_tokens: int  # the prompt's prefix cached there
    kv_fraction: float | None  # projected active KV blocks over capacity; None: capacity unknown
    queued_tokens: int  # prefill work waiting there
    running: int  # requests decoding there
    transfer_ms_p50: float = 0.0  # the median time of its recent KV transfers (0: none reported)


def queued_prefill_tokens(kv: KvRouter, worker: tuple[int, int]) -> int:
    """Prefill tokens waiting on ``worker``: the larger of its report and the router's count."""
    return local_choice.queued_prefill_tokens(kv.active, kv.busy, worker)


def prefill_queue_tokens(kv: KvRouter, decision: RoutingDecision) -> int:
    """The chosen prefill worker's queue before this request (the router counted it already
    when ``select_worker`` tracked it: its uncached tokens are taken off again)."""
    queued = queued_prefill_tokens(kv, decision.worker)
    if decision.request_id in kv.active:
        queued -= max(decision.isl - decision.overlap_blocks * kv.block_size, 0)
    return max(queued, 0)


def decode_load(kv: KvRouter, decision: RoutingDecision, isl: int) -> DecodeLoad:
    """The decode worker ``decision`` names (a ``best_worker`` estimate: nothing counted)."""
    worker = decision.worker
    capacity = local_choice.kv_capacity(kv.busy, worker)
    fraction = decision.winner.decode_blocks / capacity if capacity else None
    latest = kv.busy.latest(worker)
    return DecodeLoad(
        min(decision.overlap_blocks * kv.block_size, isl), fraction, queued_prefill_tokens(kv, worker),
        local_choice.running_decodes(kv.active, kv.busy, worker), latest.kv_transfer_ms_p50 if latest is not None else 0.0,
    )
