"""What the router decided and why: the per-candidate costs behind every routing decision.

Returned by every selection; the frontend can put ``to_header()`` in an ``x-dynamo-route-explain``
response header (``explain()`` as JSON: the winner and the best few candidates, every value under a
label, worker ids as 16 hex digits), and the decision publisher
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

from dynamod.shared.protocol.worker_id import worker_id_hex

# Why the winner won.
REASON_ONLY_CANDIDATE = "only_candidate"
REASON_LOWEST_COST = "lowest_cost"
REASON_TIE_SMALLEST_TREE = "tie_smallest_tree"
REASON_TIE_RANDOM = "tie_random"
REASON_SAMPLED = "sampled"
REASON_SESSION = "session"  # the session's worker, kept (session affinity)
REASON_LOWEST_LOCAL_MS = "lowest_local_ms"  # a locally prefilled prompt's decode worker, by predicted time

# How a frontend (or ``--role router``) picks a worker (``--router-mode``); here so that the
# supervisor offers the same choices without importing the frontend.
ROUTER_MODE_ROUND_ROBIN = "round-robin"
ROUTER_MODE_RANDOM = "random"
ROUTER_MODE_KV = "kv"
ROUTER_MODES = (ROUTER_MODE_ROUND_ROBIN, ROUTER_MODE_RANDOM, ROUTER_MODE_KV)

HEADER_NAME = "x-dynamo-route-explain"
HEADER_MAX_CANDIDATES = 8  # keeps the header well under common 8 KiB header limits
# The header's JSON layout: every value under a label, worker ids as ``worker_id_hex``. Version 2
# replaced version 1's short keys (``w``, ``ov``, ``c``...) and positional candidate arrays.
HEADER_SCHEMA_VERSION = 2

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


class DisaggCost(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The cost-based policy's numbers (milliseconds, tokens, bytes): predicted time to first token
    if the decode worker prefills the prompt itself (local) against the prefill pool (remote).

    Local: ``local_prefill_tokens`` (prompt not cached on the decode worker) computed after the
    ``local_queued_tokens`` already waiting there, in ``local_compute_ms``, plus the decode step
    every prefill chunk rides with while ``running_decodes`` run there; ``local_overhead_ms``
    the local path's measured extra cost (in ``local_ttft_ms``); ``local_interference_ms``
    is the stall the prompt's per-token compute puts on those decodes, summed over them (at least
    one), weighted into ``local_cost_ms``. Remote: the prefill
    worker's queue and the prompt not cached there (``remote_compute_ms``), the transfer of the
    blocks the decode worker lacks (``transfer_bytes`` at ``bandwidth_gb_s``, ``bandwidth_source``
    ``measured`` or ``config``; ``transfer_exposed_ms`` the part of it still running when the
    prefill ends, all of it when ``transfer_overlap`` is ``none``), the decode worker's first step and the remote path's measured
    extra cost (``remote_overhead_ms``: request hops, the pull's wait for an engine step). The
    lower cost wins; ties go local."""

    local_prefill_tokens: int = 0
    local_queued_tokens: int = 0
    running_decodes: int = 0
    local_compute_ms: float = 0.0
    local_overhead_ms: float = 0.0
    local_ttft_ms: float = 0.0
    local_interference_ms: float = 0.0
    local_cost_ms: float = 0.0
    remote_prefill_tokens: int = 0
    remote_queued_tokens: int = 0
    remote_queue_ms: float = 0.0
    remote_compute_ms: float = 0.0
    transfer_bytes: int = 0
    bandwidth_gb_s: float = 0.0
    bandwidth_source: str = ""
    transfer_ms: float = 0.0
    transfer_exposed_ms: float = 0.0  # the part of ``transfer_ms`` after the prefill ends (in the TTFT)
    transfer_overlap: str = ""  # ``none``: blocks move after the prefill; ``chunk``/``layer``: as each chunk/layer is computed
    decode_start_ms: float = 0.0
    remote_overhead_ms: float = 0.0
    remote_ttft_ms: float = 0.0
    remote_cost_ms: float = 0.0
    compute_model: str = ""  # where compute times come from (``mocker``, ``profile:<file>``)


class DisaggInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Why a request was (or was not) prefilled on the prefill pool.

    ``reason`` is a short snake_case word (``no_prefill_workers``, ``isl_bounding``,
    ``prefill_busy``, ``prefill_failed``, ``always``, ``cost_local``, ``cost_remote``...);
    ``detail`` is the same in words with the numbers that decided it; ``cost`` the cost-based
    policy's whole prediction."""

    mode: str  # DISAGG_REMOTE | DISAGG_LOCAL
    policy: str  # the conditional-disaggregation policy in force
    reason: str
    detail: str = ""
    isl: int = 0  # prompt tokens
    effective_isl: int = 0  # prompt tokens minus the prefix the chosen decode worker caches
    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None
    decode_worker_id: int | None = None  # the decode worker the policy weighed (its estimate)
    prefill_cached_tokens: int | None = None  # the prompt's prefix cached on the prefill worker
    cost: DisaggCost | None = None

    def explain(self) -> dict[str, Any]:
        """The labelled ``disagg`` object of ``x-dynamo-route-explain`` (ids in hex)."""
        body: dict[str, Any] = msgspec.to_builtins(self)
        for key in ("prefill_worker_id", "decode_worker_id"):
            value = body.get(key)
            if value is not None:
                body[key] = worker_id_hex(value)
        return body


# Session affinity (``x-dynamo-session-id``): what became of the session's binding.
SESSION_NEW = "new"  # no live binding: routed by the mode, then bound there
SESSION_KEPT = "kept"  # routed to the worker the session held
SESSION_MOVED = "moved"  # its worker could not take it (``reason``): routed by the mode, bound there
SESSION_OUTCOMES = (SESSION_NEW, SESSION_KEPT, SESSION_MOVED)
# Why a session left its worker.
SESSION_GONE = "gone"  # the worker left discovery
SESSION_DRAINING = "draining"
SESSION_SLEEPING = "sleeping"
SESSION_UNAVAILABLE = "unavailable"  # quarantined after a failed connection, or failed this request
SESSION_BUSY = "busy"  # past the router's busy threshold


class SessionInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The ``session`` object of ``x-dynamo-route-explain``: which worker the session held, and
    whether it stayed there or moved and why. ``expired``: the session had a binding whose idle
    TTL had run out, so it was routed as new."""

    session_id: str
    outcome: str  # SESSION_NEW | SESSION_KEPT | SESSION_MOVED
    worker_id: int = 0  # where the request went (and the session is bound now)
    dp_rank: int = 0
    held_worker_id: int | None = None
    held_dp_rank: int | None = None
    reason: str = ""  # SESSION_GONE ... SESSION_BUSY when moved
    expired: bool = False

    def explain(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.session_id, "outcome": self.outcome, "worker_id": worker_id_hex(self.worker_id),
                                "dp_rank": self.dp_rank}
        if self.held_worker_id is not None:
            body["held_worker_id"] = worker_id_hex(self.held_worker_id)
            body["held_dp_rank"] = self.held_dp_rank or 0
        if self.reason:
            body["reason"] = self.reason
        if self.expired:
            body["expired"] = True
        return body


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

    def explain(self) -> dict[str, Any]:
        """The ``x-dynamo-route-explain`` object: the winner, why, and the cheapest candidates,
        every value labelled and every worker id in hex (``worker_id_hex``). A candidate lists
        ``host_overlap_blocks``/``disk_overlap_blocks`` only when it holds prompt blocks below
        its device cache."""
        best = sorted(self.candidates, key=lambda c: c.cost)[:HEADER_MAX_CANDIDATES]
        body: dict[str, Any] = {
            "schema": HEADER_SCHEMA_VERSION,
            "stage": self.stage,
            "worker_id": worker_id_hex(self.worker_id),
            "dp_rank": self.dp_rank,
            "reason": self.reason,
            "overlap_blocks": self.overlap_blocks,
            "request_blocks": self.request_blocks,
            "isl": self.isl,
            "overlap_weight": self.overlap_weight,
            "candidates_total": len(self.candidates),
            "busy_total": len(self.busy),
            "candidates": [_candidate(c) for c in best],
        }
        if self.busy:
            body["busy"] = [
                {"worker_id": worker_id_hex(w), "dp_rank": r, "reason": why} for w, r, why in self.busy[:HEADER_MAX_CANDIDATES]
            ]
        if self.disagg is not None:
            body["disagg"] = self.disagg.explain()
        return body

    def to_header(self) -> str:
        """``explain()`` as compact JSON, for the ``x-dynamo-route-explain`` header."""
        return _json.encode(self.explain()).decode("ascii")


def _candidate(c: CandidateScore) -> dict[str, Any]:
    out: dict[str, Any] = {
        "worker_id": worker_id_hex(c.worker_id),
        "dp_rank": c.dp_rank,
        "overlap_blocks": c.overlap_blocks,
        "prefill_tokens": c.prefill_tokens,
        "prefill_blocks": round(c.prefill_blocks, 3),
        "decode_blocks": c.decode_blocks,
        "cost": round(c.cost, 3),
    }
    if c.host_overlap_blocks or c.disk_overlap_blocks:
        out["host_overlap_blocks"] = c.host_overlap_blocks
        out["disk_overlap_blocks"] = c.disk_overlap_blocks
    return out


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
