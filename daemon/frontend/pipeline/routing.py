"""The frontend's routing seam: which worker serves a request.

A ``Router`` picks one of the candidates the caller hands it (ready workers of the model, minus
the ones this request already failed on and the ones recently found dead) and hears when the
request's first token arrives and when it ends, which is what a KV-aware router needs to track
active sequences. The choice it returns carries its own explanation (the kv router's
``RoutingDecision``), which the caller keeps on the request object and reads back for the
``x-dynamo-route-explain`` header: no side channel.

With disaggregated serving the same seam routes two stages: ``stage`` says which (``prefill``:
the prefill pool; ``decode``: the decode pool, where a remotely prefilled prompt is routed with
the disaggregation policy's ``decode_overlap_weight``); ``estimate`` answers "which decode worker, and how much of the
prompt does it cache" without routing, for the conditional-disaggregation policy. Round-robin and random keep no per-request state. Direct routing (the
``x-dynamo-worker-instance-id`` header) bypasses the router altogether.

Session affinity (``session_routing.py``) wraps every mode: a request's ``session`` names it, and
``pinned`` is the worker its session is bound to, which round-robin and random take as given and
the KV router takes unless that worker is busy.

``Quarantine`` remembers workers whose connection just failed: their discovery record outlives
them by up to one lease TTL, and without it every new request in that window would walk into the
dead worker and spend a migration.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.llm import MultimodalItem, PrefixPin
from dynamod.shared.protocol.routing import (
    ROUTER_MODE_RANDOM,
    ROUTER_MODE_ROUND_ROBIN,
    ROUTER_MODES,
    STAGE_AGG,
    DisaggInfo,
    RoutingDecision,
    SessionInfo,
)


@dataclass(frozen=True, slots=True)
class SessionRef:
    """The session a request belongs to (``x-dynamo-session-id``, ``nvext.session_control``)."""

    session_id: str
    ttl_s: float | None = None  # ``nvext.session_control.timeout``; None: the router's TTL
    close: bool = False  # ``action: "close"``: the binding ends with this request


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    token_ids: list[int]
    lora_name: str | None = None
    stage: str = STAGE_AGG
    overlap_weight: float | None = None  # None: the router's configured weight
    disagg: DisaggInfo | None = None  # on the decode stage: where the prompt was prefilled
    session: SessionRef | None = None
    # Set by the session layer (session_routing.py): the (worker, dp rank) the session is bound
    # to, checked routable; every mode sends the request there unless (kv) it is busy.
    pinned: tuple[int, int] | None = None
    priority: int = 0  # Dynamo's request priority (higher first): orders the KV router's wait queue
    # The prompt's images: the KV router keys the blocks that cover them by content (shared/kv/hashing.py).
    mm_items: list[MultimodalItem] | None = None
    # cache_control: the KV router credits the chosen worker with this prefix until its TTL.
    prefix_pin: PrefixPin | None = None


@dataclass(slots=True)
class RouteChoice:
    instance: Instance
    dp_rank: int | None = None
    overlap_blocks: int = 0
    stage: str = STAGE_AGG
    explain: RoutingDecision | None = None  # the kv router's decision; None for round-robin/random
    load: float | None = None  # prefill stage: the worker's queued prefill tokens, when known
    session: SessionInfo | None = None  # session affinity: held, kept or moved and why

    @property
    def worker_id(self) -> int:
        return self.instance.instance_id


@dataclass(slots=True)
class DecodeEstimate:
    """The decode worker a request would get, without routing it (conditional disaggregation)."""

    worker_id: int
    cached_tokens: int  # the prompt's prefix already cached there
    kv_fraction: float | None  # its projected active KV blocks over its capacity; None: unknown
    queued_tokens: int = 0  # prefill tokens already waiting there
    running: int = 0  # requests decoding there
    transfer_ms_p50: float = 0.0  # the median time of its recent KV transfers (0: none reported)


class Router(Protocol):
    """Chooses a worker among ``candidates`` (never empty) and tracks requests it routed.
    ``select`` may wait (the KV router queues a request while every worker is busy)."""

    name: str

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice: ...

    def estimate(self, request: RouteRequest, candidates: Sequence[Instance]) -> DecodeEstimate | None:
        """What ``select`` would pick and what it caches, counting nothing; None: no cache view."""
        ...

    def record(self, choice: RouteChoice, model: str) -> None:
        """A choice the caller acted on, for the published decisions (the prefill stage picks
        before it knows whether the prompt goes remote; ``select`` publishes everything else)."""
        ...

    def on_first_token(self, request_id: str) -> None: ...

    def on_finish(self, request_id: str) -> None: ...


class StatelessRouter:
    """A router that picks without looking at caches or load: it estimates nothing and has no
    request to track, so the Router members after ``select`` do nothing."""

    name: str

    def estimate(self, request: RouteRequest, candidates: Sequence[Instance]) -> DecodeEstimate | None:
        return None

    def record(self, choice: RouteChoice, model: str) -> None:
        return None

    def on_first_token(self, request_id: str) -> None:
        return None

    def on_finish(self, request_id: str) -> None:
        return None


class RoundRobinRouter(StatelessRouter):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        pinned = pinned_choice(request, candidates)
        if pinned is not None:
            return pinned  # the turn is not taken: the others keep their share
        return RouteChoice(candidates[next(self._counter) % len(candidates)], stage=request.stage)


class RandomRouter(StatelessRouter):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        pinned = pinned_choice(request, candidates)
        if pinned is not None:
            return pinned
        return RouteChoice(candidates[self._rng.randrange(len(candidates))], stage=request.stage)


def pinned_choice(request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice | None:
    """The session's worker when it is among ``candidates`` (round-robin and random know no
    load: a routable worker always takes its session)."""
    pinned = request.pinned
    if pinned is None:
        return None
    for inst in candidates:
        if inst.instance_id == pinned[0]:
            return RouteChoice(inst, dp_rank=pinned[1] or None, stage=request.stage)
    return None


def parse_instance_id(value: str) -> int:
    """Reads a ``x-dynamo-worker-instance-id`` header: hex (as printed everywhere) or decimal.

    Ids are printed in hex without ``0x``, so a value with a hex letter or a ``0x`` prefix is hex;
    an all-digit value is tried as hex first only when no instance has that decimal id, which the
    caller resolves with ``candidates_for_header``.
    """
    text = value.strip().lower()
    if not text:
        raise InvalidRequestError("empty x-dynamo-worker-instance-id header")
    try:
        if text.startswith("0x"):
            return int(text, 16)
        return int(text, 16) if any(c in "abcdef" for c in text) else int(text, 10)
    except ValueError:
        raise InvalidRequestError(f"x-dynamo-worker-instance-id {value!r} is neither hex nor decimal") from None


def header_candidates(value: str) -> list[int]:
    """Every id the header may mean: an all-digit value may be decimal or hex."""
    primary = parse_instance_id(value)
    text = value.strip().lower()
    out = [primary]
    if text.isdigit():
        alt = int(text, 16)
        if alt != primary:
            out.append(alt)
    return out


class Quarantine:
    """Workers to avoid for a while after their connection failed."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._until: dict[int, float] = {}

    def add(self, worker_id: int, hold_s: float | None = None) -> None:
        self._until[worker_id] = time.monotonic() + (self.hold_s if hold_s is None else hold_s)

    def discard(self, worker_id: int) -> None:
        self._until.pop(worker_id, None)

    def __contains__(self, worker_id: int) -> bool:
        until = self._until.get(worker_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._until[worker_id]
            return False
        return True

    def __len__(self) -> int:
        return len(self._until)


def make_basic_router(mode: str) -> Router:
    """Round-robin or random; the kv mode is built by ``kv_routing.KvRouting`` per model."""
    if mode == ROUTER_MODE_ROUND_ROBIN:
        return RoundRobinRouter()
    if mode == ROUTER_MODE_RANDOM:
        return RandomRouter()
    raise ConfigError(f"unknown router mode {mode!r}; choose one of {', '.join(ROUTER_MODES)}")
