"""What the router decided and why: the per-candidate costs behind every routing decision.

Returned by every selection; the frontend can put ``to_header()`` in an ``x-dynamo-route-explain``
response header (compact: the winner and the best few candidates), and the decision publisher
sends it on the ``router_decisions`` topic as a ``PublishedDecision`` (everything, plus when and
where it was made) for the console.

With disaggregated serving one request gives up to two decisions, told apart by ``stage``:
``prefill`` (the prefill pool, KV-aware, no active-block tracking) and ``decode`` (the decode pool,
no overlap credit); ``agg`` is the plain one-pool decision. ``disagg`` says, on the decode (or
local-prefill) decision, whether the prompt was prefilled remotely or locally and why.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Why the winner won.
REASON_ONLY_CANDIDATE = "only_candidate"
REASON_LOWEST_COST = "lowest_cost"
REASON_TIE_SMALLEST_TREE = "tie_smallest_tree"
REASON_TIE_RANDOM = "tie_random"
REASON_SAMPLED = "sampled"

HEADER_NAME = "x-dynamo-route-explain"
HEADER_MAX_CANDIDATES = 8  # keeps the header well under common 8 KiB header limits

_json = msgspec.json.Encoder()


class CandidateScore(msgspec.Struct, gc=False):
    """One candidate's terms in ``cost = overlap_weight * prefill_blocks + decode_blocks``.
    Positional construction (the scheduler builds one per candidate per request). ``gc=False``:
    only scalar fields, so never part of a cycle; a thousand per decision would otherwise each
    count towards the next garbage-collector pass."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int  # leading prompt blocks already cached there
    prefill_tokens: int  # its active prefill tokens + the prompt tokens not cached there
    prefill_blocks: float  # prefill_tokens / block_size, not rounded
    decode_blocks: int  # its active blocks + the prompt blocks new to it
    cost: float
    tree_size: int  # blocks it caches on the device (first tie-breaker)
    probability: float | None = None  # sampling probability when temperature > 0
    # KV tiers (shared/kv/index_tiers.py): the prompt blocks after ``overlap_blocks`` found in the
    # worker's host memory, then on its disk, each credited at its tier's weight in
    # ``prefill_blocks`` (``prefill_tokens`` does not include the credit).
    host_overlap_blocks: int = 0
    disk_overlap_blocks: int = 0
    tier_credit_blocks: float = 0.0  # host_weight * host_overlap_blocks + disk_weight * disk_overlap_blocks


# Stages of a routing decision.
STAGE_AGG = "agg"
STAGE_PREFILL = "prefill"
STAGE_DECODE = "decode"

# Disaggregation: where the prompt was prefilled.
DISAGG_REMOTE = "remote"
DISAGG_LOCAL = "local"


class DisaggInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Why a request was (or was not) prefilled on the prefill pool.

    ``reason`` is a short snake_case word (``no_prefill_workers``, ``isl_bounding``,
    ``prefill_busy``, ``prefill_failed``, ``always``, ...); ``detail`` is the same in words with
    the numbers that decided it."""

    mode: str  # DISAGG_REMOTE | DISAGG_LOCAL
    policy: str  # the conditional-disaggregation policy in force
    reason: str
    detail: str = ""
    isl: int = 0  # prompt tokens
    effective_isl: int = 0  # prompt tokens minus the best cached prefix on the prefill pool
    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None


class RoutingDecision(msgspec.Struct, kw_only=True):
    request_id: str
    worker_id: int
    dp_rank: int = 0
    overlap_blocks: int  # the winner's cached leading blocks
    request_blocks: int  # full prompt blocks (what could be cached)
    isl: int  # prompt tokens
    reason: str  # one of REASON_*
    detail: str  # the reason in words, with the numbers
    overlap_weight: float
    temperature: float
    candidates: list[CandidateScore]
    busy: list[tuple[int, int, str]] = []  # skipped (worker_id, dp_rank, why busy)
    stage: str = STAGE_AGG  # STAGE_AGG | STAGE_PREFILL | STAGE_DECODE
    disagg: DisaggInfo | None = None

    @property
    def worker(self) -> tuple[int, int]:
        return (self.worker_id, self.dp_rank)

    @property
    def winner(self) -> CandidateScore:
        for c in self.candidates:
            if c.worker_id == self.worker_id and c.dp_rank == self.dp_rank:
                return c
        raise LookupError("winner missing from candidates")

    def to_dict(self) -> dict[str, Any]:
        """Everything, as JSON-compatible builtins (for publishing)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    def to_header(self) -> str:
        """Compact JSON for the ``x-dynamo-route-explain`` header: winner, reason, and the
        cheapest candidates as ``[worker_id, dp_rank, overlap, prefill_blocks, decode_blocks,
        cost]``; ``tiers`` lists those among them holding prompt blocks below the device as
        ``[worker_id, dp_rank, host_blocks, disk_blocks]``."""
        best = sorted(self.candidates, key=lambda c: c.cost)[:HEADER_MAX_CANDIDATES]
        body = {
            "w": self.worker_id,
            "dp": self.dp_rank,
            "ov": self.overlap_blocks,
            "blocks": self.request_blocks,
            "why": self.reason,
            "n": len(self.candidates),
            "busy": len(self.busy),
            "stage": self.stage,
            "c": [[c.worker_id, c.dp_rank, c.overlap_blocks, round(c.prefill_blocks, 3), c.decode_blocks, round(c.cost, 3)] for c in best],
        }
        tiers = [[c.worker_id, c.dp_rank, c.host_overlap_blocks, c.disk_overlap_blocks] for c in best if c.host_overlap_blocks or c.disk_overlap_blocks]
        if tiers:  # only when some candidate holds the prompt below its device cache
            body["tiers"] = tiers
        if self.disagg is not None:
            body["disagg"] = msgspec.to_builtins(self.disagg)
        return _json.encode(body).decode("ascii")


class PublishedDecision(RoutingDecision, kw_only=True):
    """A decision as published on ``router_decisions``: the decision's own fields, flat (a reader
    that knows only ``RoutingDecision`` decodes it too), then when and by whom it was made.
    ``model`` is left out when the publisher does not know it."""

    ts: float = 0.0  # unix time the publisher queued it
    source: str = ""  # the publisher's component (``frontend``, the router's)
    router_instance_id: str = ""  # the publisher's instance id, hex
    model: str | msgspec.UnsetType = msgspec.UNSET

    @classmethod
    def of(cls, decision: RoutingDecision, *, ts: float, source: str, router_instance_id: str, model: str = "") -> PublishedDecision:
        return cls(
            **msgspec.structs.asdict(decision),
            ts=ts,
            source=source,
            router_instance_id=router_instance_id,
            model=model or msgspec.UNSET,
        )


published_decision_encoder = msgspec.msgpack.Encoder()
published_decision_decoder = msgspec.msgpack.Decoder(PublishedDecision)
