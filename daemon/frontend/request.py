"""The request object the frontend pipeline passes down and reads back up.

The endpoint builds one ``FrontendRequest`` per HTTP request; the engine stream fills it as the
request runs (where each stage was routed and why, where the prompt was prefilled, the tokens
generated, migrations, timings), and the endpoint reads it back for the response headers, usage
and metrics. One object instead of parameter lists that grow with every stage, and instead of
side channels: the route explanation is simply the choices kept here.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamod.daemon.frontend.routing import RouteChoice
from dynamod.shared.protocol.routing import HEADER_NAME, HEADER_SCHEMA_VERSION, DisaggInfo
from dynamod.shared.protocol.worker_id import worker_id_hex

if TYPE_CHECKING:
    from dynamod.daemon.frontend.models import ServedModel
    from dynamod.shared.protocol.llm import PreprocessedRequest

EXPLAIN_HEADER = HEADER_NAME.encode("latin-1")


@dataclass(eq=False, slots=True)
class FrontendRequest:
    request_id: str
    model: ServedModel  # follows the name if the model is replaced while the request waits
    preprocessed: PreprocessedRequest
    started_at: float  # time.perf_counter() at arrival
    direct_ids: list[int] | None = None  # x-dynamo-worker-instance-id
    migration_limit: int = 3
    # Filled while it runs.
    decode_route: RouteChoice | None = None  # the last decode (or agg) routing
    prefill_route: RouteChoice | None = None  # the last remote prefill routing
    disagg: DisaggInfo | None = None  # the last prefill decision (None: aggregated model)
    prefill_s: float | None = None  # the last remote prefill: sent -> transfer params
    migrations: int = 0
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    prefill_drains: list[asyncio.Task[None]] = field(default_factory=list)

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
        disaggregated model, naming the workers, the stages and the disaggregation decision.
        Every value is labelled and every worker id is ``worker_id_hex``."""
        route = self.decode_route
        if route is None:
            return None
        if self.disagg is None:
            return route.explain.to_header() if route.explain is not None else None
        body = _route_dict(route)
        body["disagg"] = self.disagg.explain()
        if self.prefill_route is not None:
            body["prefill"] = _route_dict(self.prefill_route)
        return json.dumps(body, separators=(",", ":"))


def _route_dict(route: RouteChoice) -> dict[str, Any]:
    if route.explain is not None:
        return route.explain.explain()
    # Round-robin and random weigh nothing: the worker and the stage are the whole story.
    return {
        "schema": HEADER_SCHEMA_VERSION, "stage": route.stage, "worker_id": worker_id_hex(route.worker_id),
        "dp_rank": route.dp_rank or 0, "reason": "no_kv_router",
    }
