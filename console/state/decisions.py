"""Router decisions as the console keeps them, and the tally of where prompts were prefilled.

Messages on ``router_decisions`` are ``RoutingDecision.to_dict()`` plus the publisher's ``ts``,
``source`` and ``model``; they are decoded with the wire type itself (``msgspec.convert``), so a
field renamed in ``shared/protocol/routing.py`` fails here loudly instead of turning into blanks.

With disaggregated serving the decode (or local-prefill) decision carries ``disagg``: whether the
prompt was prefilled on the prefill pool (remote) or by the decode worker itself (local), and why.
``DisaggTally`` counts both and keeps the latest reasons, which is what tells an operator whether
the prefill pool is doing its job or the conditional policy keeps it idle.

Planner decisions are typed (``PlannerDecision``) and kept by ``scaling.py``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamod.console.state.records import Candidate, RouterDecision
from dynamod.shared.protocol.routing import DISAGG_REMOTE, RoutingDecision

LATEST_DISAGG = 20


def decode_decision(namespace: str, data: Mapping[str, Any], now: float) -> RouterDecision:
    """The console's record of one published decision. Raises ``msgspec.ValidationError`` when the
    message is not a ``RoutingDecision``."""
    wire = msgspec.convert(dict(data), RoutingDecision)
    ts = data.get("ts")
    return RouterDecision(
        ts=float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) and ts > 0 else now,
        namespace=namespace,
        worker_id=wire.worker_id,
        dp_rank=wire.dp_rank,
        overlap_blocks=wire.overlap_blocks,
        request_id=wire.request_id,
        isl_blocks=wire.request_blocks,
        candidates=[
            Candidate(c.worker_id, c.dp_rank, c.overlap_blocks, c.prefill_blocks, c.decode_blocks, c.cost, c.tree_size)
            for c in wire.candidates
        ],
        reason=wire.reason,
        busy=len(wire.busy),
        stage=wire.stage,
        disagg=wire.disagg,
        model=str(data.get("model") or ""),
    )


@dataclass(slots=True)
class DisaggTally:
    """Remote vs local prefill since the console started, with reasons, and the latest decisions."""

    remote: int = 0
    local: int = 0
    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)  # (mode, reason) -> count
    latest: deque[RouterDecision] = field(default_factory=lambda: deque(maxlen=LATEST_DISAGG))

    @property
    def total(self) -> int:
        return self.remote + self.local

    def add(self, d: RouterDecision) -> None:
        info = d.disagg
        if info is None:
            return
        if info.mode == DISAGG_REMOTE:
            self.remote += 1
        else:
            self.local += 1
        self.reasons[(info.mode, info.reason)] += 1
        self.latest.append(d)

    def top_reasons(self, mode: str, limit: int = 3) -> list[tuple[str, int]]:
        """The most frequent reasons for ``mode`` (remote | local), most frequent first."""
        found = [(reason, n) for (m, reason), n in self.reasons.items() if m == mode]
        found.sort(key=lambda rn: (-rn[1], rn[0]))
        return found[:limit]


class DecisionLog:
    """The last decisions (newest last) and the disaggregation tally over all of them."""

    def __init__(self, maxlen: int) -> None:
        self.decisions: deque[RouterDecision] = deque(maxlen=maxlen)
        self.disagg = DisaggTally()
        self.stages: Counter[str] = Counter()

    def add(self, d: RouterDecision) -> None:
        self.decisions.append(d)
        self.stages[d.stage] += 1
        self.disagg.add(d)

