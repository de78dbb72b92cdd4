"""The router role's ``best_worker_id`` endpoint: which worker would serve these tokens.

For callers that send the request themselves: the router answers without counting anything.
``stage`` ``prefill`` asks the prefill pool; ``decode`` the decode pool as a remotely prefilled
request sees it (overlap weight 0 unless given); none: the plain one-pool decision. Bodies travel
on the request plane (msgpack maps).
"""

from __future__ import annotations

import msgspec

from dynamod.shared.protocol.routing import RoutingDecision


class BestWorkerRequest(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    lora_name: str | None = None
    overlap_weight: float | None = None
    temperature: float | None = None
    request_id: str | None = None
    stage: str | None = None  # None: the plain decision; STAGE_PREFILL | STAGE_DECODE: that stage's


class BestWorkerAnswer(msgspec.Struct, kw_only=True):
    worker_id: int
    dp_rank: int
    overlap_blocks: int  # the chosen worker's cached leading blocks of the prompt
    explain: RoutingDecision  # the whole decision, as published on router_decisions

    @classmethod
    def of(cls, decision: RoutingDecision) -> BestWorkerAnswer:
        return cls(
            worker_id=decision.worker_id,
            dp_rank=decision.dp_rank,
            overlap_blocks=decision.overlap_blocks,
            explain=decision,
        )
