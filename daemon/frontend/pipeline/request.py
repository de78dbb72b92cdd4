"""The request objects the frontend pipeline passes down and reads back up.

``FrontendRequest`` is made at the door, once per HTTP request, by the endpoint that decoded the
body: it carries the scope and the reply channel, the typed request body, the client watch, the
start time, the model and, once the API surface has planned it, the ``Plan``. Everything past the
door (``serve.GenerationEndpoint.serve``, the response writers, the fan-out) takes this one object
instead of parameter lists that grow with every stage.

``EngineRequest`` is one generation of it (a fan-out request has several): the engine stream fills
it as the generation runs (where each stage was routed and why, where the prompt was prefilled,
the tokens generated, migrations, timings), and the writers read it back for the response headers,
usage and metrics. The route explanation is simply the choices kept here, not a side channel.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dynamod.daemon.frontend.http.asgi import DisconnectWatch, Scope, header
from dynamod.daemon.frontend.pipeline.routing import RouteChoice, SessionRef, header_candidates
from dynamod.daemon.frontend.pipeline.session_routing import session_of
from dynamod.shared.protocol.routing import HEADER_NAME, HEADER_SCHEMA_VERSION, DisaggInfo
from dynamod.shared.protocol.worker_id import worker_id_hex

if TYPE_CHECKING:
    from dynamod.daemon.frontend.parsers import OutputParser
    from dynamod.daemon.frontend.pipeline.models import ServedModel
    from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
    from dynamod.shared.observability.tracing import Span
    from dynamod.shared.protocol.llm import (
        MultimodalItem,
        PrefixPin,
        PreprocessedRequest,
        RoutingHints,
        SamplingOptions,
        SlaTargets,
    )

EXPLAIN_HEADER = HEADER_NAME.encode("latin-1")
WORKER_HEADER = b"x-dynamo-worker-instance-id"
_EXPLAIN_ON = ("1", "true", "yes", "on")

BodyT = TypeVar("BodyT")


def wants_explain(scope: Scope) -> bool:
    """The client asked for the route explanation (``x-dynamo-route-explain: 1``)."""
    return (header(scope, EXPLAIN_HEADER) or "").strip().lower() in _EXPLAIN_ON


@dataclass(eq=False, slots=True)
class Plan:
    """What the API surface decides before generation starts: the prompt, the output budget and
    the options the engines and the output side need. Made by the surface (it reads its own
    request body); the pipeline only reads it."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions | None = None  # set once per request (a fan-out compiles its grammar once)
    logprobs: int | None = None  # top log-probabilities per token; None: none asked for
    echo_text: str = ""  # text the response repeats before the generated text (completions echo)
    stops: list[str] = field(default_factory=list)
    parser: OutputParser | None = None  # tool calls and reasoning in the output (chat)
    min_tokens: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sla: SlaTargets | None = None  # nvext router targets
    routing: RoutingHints | None = None  # nvext routing hints (priority)
    pin: PrefixPin | None = None  # cache_control: the prompt prefix to keep cached on the worker
    mm_items: list[MultimodalItem] | None = None  # the prompt's images (preprocess/media), in order


@dataclass(eq=False, slots=True)
class FrontendRequest(Generic[BodyT]):
    """One HTTP request from the door on; ``body`` is the surface's typed request."""

    request_id: str
    scope: Scope
    send: Any  # the ASGI send of the reply
    body: BodyT
    model: ServedModel
    started_at: float  # time.perf_counter() at arrival
    watch: DisconnectWatch
    stream: bool = False
    explain: bool = False  # x-dynamo-route-explain asked for
    # Set once the surface planned it.
    plan: Plan | None = None
    preprocessor: ModelPreprocessor | None = None
    engine: EngineRequest | None = None  # the (first) generation: the one the route headers name
    trace: Span | None = None  # the request's root span (pipeline/tracing.py)

    @property
    def direct_ids(self) -> list[int] | None:
        """``x-dynamo-worker-instance-id``: the workers the client pinned the request to."""
        direct = header(self.scope, WORKER_HEADER)
        return header_candidates(direct) if direct else None

    @property
    def session(self) -> SessionRef | None:
        """The session the request belongs to (``x-dynamo-session-id``, ``nvext.session_control``)."""
        return session_of(self.scope, self.body)

    def route_headers(self, engine: EngineRequest | None = None) -> list[tuple[bytes, bytes]]:
        """The worker that answered and, when asked for and there is one, the route explanation
        (of ``engine``, default the request's first generation). After a migration both name the
        last routing, the one that produced the answer."""
        engine = engine if engine is not None else self.engine
        assert engine is not None
        headers = [(WORKER_HEADER, worker_id_hex(engine.worker_id).encode())]
        if self.explain:
            value = engine.explain_header()
            if value is not None:
                headers.append((EXPLAIN_HEADER, value.encode("latin-1")))
        return headers


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One generation's request to the engines, and what it learns on the way."""

    request_id: str
    model: ServedModel  # follows the name if the model is replaced while the request waits
    preprocessed: PreprocessedRequest
    started_at: float  # time.perf_counter() at arrival
    direct_ids: list[int] | None = None  # x-dynamo-worker-instance-id
    migration_limit: int = 3
    session: SessionRef | None = None  # session affinity
    # Filled while it runs.
    decode_route: RouteChoice | None = None  # the last decode (or agg) routing
    prefill_route: RouteChoice | None = None  # the last remote prefill routing
    disagg: DisaggInfo | None = None  # the last prefill decision (None: aggregated model)
    prefill_s: float | None = None  # the last remote prefill: sent -> transfer params
    migrations: int = 0
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    pinned_tokens: int = 0  # prompt tokens newly pinned by ``preprocessed.pin`` (beyond cached_tokens)
    pin_refused: bool = False  # the worker refused the pin (its pinned share was full)
    finish_reason: str | None = None
    prefill_drains: list[asyncio.Task[None]] = field(default_factory=list)
    kv_transfer: dict[str, Any] | None = None  # the decode worker's KV transfer report (remote prefill)
    trace: Span | None = None  # the parent of this generation's spans (the request's root span)

    @property
    def prompt_len(self) -> int:
        return len(self.preprocessed.token_ids)

    @property
    def worker_id(self) -> int | None:
        """The decode worker that produced the answer (after a migration: the last one)."""
        route = self.decode_route
        return None if route is None else route.worker_id

    def explain_header(self) -> str | None:
        """``x-dynamo-route-explain``: the final routing as ``RoutingDecision.explain()`` (which
        carries ``stage`` and ``disagg``), plus ``prefill``: the prefill stage's own decision.
        Round-robin and random have no decision: for them the header appears only on a
        disaggregated model or a request of a session, naming the workers, the stages and the
        disaggregation decision. ``session``: the session's binding (held, kept or moved and why).
        Every value is labelled and every worker id is ``worker_id_hex``."""
        route = self.decode_route
        if route is None:
            return None
        if self.disagg is None and route.session is None:
            return route.explain.to_header() if route.explain is not None else None
        body = _route_dict(route)
        if route.session is not None:
            body["session"] = route.session.explain()
        if self.disagg is None:
            return json.dumps(body, separators=(",", ":"))
        body["disagg"] = self.disagg.explain()
        if self.kv_transfer is not None:
            body["disagg"]["transfer"] = transfer_explain(self.kv_transfer)
        if self.prefill_route is not None:
            body["prefill"] = _route_dict(self.prefill_route)
        return json.dumps(body, separators=(",", ":"))


_TRANSFER_FIELDS = ("ok", "streamed", "exposed_ms", "ms", "blocks", "bytes", "local_hit_blocks", "failure")


def transfer_explain(report: dict[str, Any]) -> dict[str, Any]:
    """The ``disagg.transfer`` object of ``x-dynamo-route-explain``: what the decode worker's KV read
    measured (``exposed_ms``: the prefill's last block computed until every block was there;
    ``streamed``: read while the prefill computed), its source worker in hex."""
    body = {k: report[k] for k in _TRANSFER_FIELDS if k in report}
    source = report.get("from_worker_id")
    if isinstance(source, int):
        body["from_worker_id"] = worker_id_hex(source)
    return body


def _route_dict(route: RouteChoice) -> dict[str, Any]:
    if route.explain is not None:
        return route.explain.explain()
    # Round-robin and random weigh nothing: the worker and the stage are the whole story.
    return {
        "schema": HEADER_SCHEMA_VERSION, "stage": route.stage, "worker_id": worker_id_hex(route.worker_id),
        "dp_rank": route.dp_rank or 0, "reason": "no_kv_router",
    }
