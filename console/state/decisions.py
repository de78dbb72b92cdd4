"""Router decisions as the console keeps them, and the tally of where prompts were prefilled.

Messages on ``router_decisions`` are ``PublishedDecision``s (``shared/protocol/routing.py``, sent by
``daemon/router/core/decision_publisher.py``). They are decoded once, straight into ``HeardDecision``:
the wire type itself plus the namespace it was heard in, so a field renamed there fails here loudly
(a decode error) instead of turning into blanks, and nothing is copied into a second record.

With disaggregated serving the decode (or local-prefill) decision carries ``disagg``: whether the
prompt was prefilled on the prefill pool (remote) or by the decode worker itself (local), and why.
``DisaggTally`` counts both and keeps the latest reasons, which is what tells an operator whether
the prefill pool is doing its job or the conditional policy keeps it idle.

Planner decisions are typed (``PlannerDecision``) and kept by ``scaling.py``.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamod.console.state.records import fmt_id, fmt_num
from dynamod.shared.protocol.routing import DISAGG_REMOTE, CandidateScore, PublishedDecision

LATEST_DISAGG = 20

# RoutingDecision.reason values (shared/protocol/routing.py) in words; the usual one says nothing.
REASON_WORDS = {
    "lowest_cost": "",
    "only_candidate": "only candidate",
    "tie_smallest_tree": "tie, smallest cache",
    "tie_random": "tie, random",
    "sampled": "sampled (temperature > 0)",
    "session": "session affinity",
    "lowest_local_ms": "local prefill, fastest",
}


class HeardDecision(PublishedDecision, kw_only=True):
    """A published routing decision as the console holds it: every wire field, and ``namespace``,
    the scope of the topic it arrived on (the console fills it; publishers do not send it)."""

    namespace: str = ""

    def chosen(self) -> CandidateScore | None:
        for c in self.candidates:
            if c.worker_id == self.worker_id and c.dp_rank == self.dp_rank:
                return c
        return None

    def prefill_text(self) -> str:
        """Where the prompt was prefilled and why, in a few words ("" without disaggregation)."""
        d = self.disagg
        if d is None:
            return ""
        if d.mode == DISAGG_REMOTE:
            where = f" on {fmt_id(d.prefill_worker_id)}" if d.prefill_worker_id is not None else ""
            return f"remote prefill{where}"
        # The reason keeps its wire spelling: it is the policy's name in flags and metric labels.
        return f"local prefill ({d.reason})" if d.reason else "local prefill"

    def cost_why(self) -> str:
        """The cost breakdown of the chosen worker and its margin over the runner-up (and, when the
        router says so, that it was a tie-break, a sample at temperature > 0, or the only choice)."""
        text = self._breakdown()
        reason = REASON_WORDS.get(self.reason, "")
        if self.busy:
            text += f"; {len(self.busy)} busy skipped"
        return f"{reason}: {text}" if reason else text

    def why(self) -> str:
        """``cost_why`` led by where the prompt was prefilled when the request was disaggregated."""
        prefill = self.prefill_text()
        return f"{prefill}; {self.cost_why()}" if prefill else self.cost_why()

    def _breakdown(self) -> str:
        chosen = self.chosen()
        if chosen is None:
            parts = [f"overlap {fmt_num(self.overlap_blocks)} blocks"]
            if self.candidates:
                parts.append(f"{len(self.candidates)} candidates")
            return ", ".join(parts)
        text = (
            f"cost {fmt_num(chosen.cost)} = prefill {fmt_num(chosen.prefill_blocks)} + decode "
            f"{fmt_num(chosen.decode_blocks)} (overlap {fmt_num(chosen.overlap_blocks)})"
        )
        others = sorted((c for c in self.candidates if c is not chosen), key=lambda c: c.cost)
        if others:
            text += f"; next {fmt_id(others[0].worker_id)} cost {fmt_num(others[0].cost)}"
        return text

    def explanation(self) -> str:
        """One line an operator can read: which worker, why, and by how much it beat the next one."""
        head = f"picked {fmt_id(self.worker_id)}" + (f"/dp{self.dp_rank}" if self.dp_rank else "")
        return f"{head}: {self.why()}"


_msgpack_decoder = msgspec.msgpack.Decoder(HeardDecision)


def decode_router_decision(payload: bytes) -> HeardDecision:
    """One ``router_decisions`` message: msgpack, as the decision publisher sends it, or a JSON
    object (a msgpack decision is a map, so a payload starting with ``{`` is JSON). Raises
    ``msgspec.DecodeError``/``msgspec.ValidationError`` when it is not a routing decision."""
    if payload.lstrip()[:1] == b"{":
        return msgspec.json.decode(payload, type=HeardDecision)
    return _msgpack_decoder.decode(payload)


def convert_router_decision(value: Any) -> HeardDecision:
    """A recorded decision (``dynamoctl watch --raw``: the decision as builtins) back into one."""
    return msgspec.convert(value, HeardDecision)


@dataclass(slots=True)
class DisaggTally:
    """Remote vs local prefill since the console started, with reasons, and the latest decisions."""

    remote: int = 0
    local: int = 0
    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)  # (mode, reason) -> count
    latest: deque[HeardDecision] = field(default_factory=lambda: deque(maxlen=LATEST_DISAGG))

    @property
    def total(self) -> int:
        return self.remote + self.local

    def add(self, d: HeardDecision) -> None:
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
        self.decisions: deque[HeardDecision] = deque(maxlen=maxlen)
        self.disagg = DisaggTally()
        self.stages: Counter[str] = Counter()

    def add(self, d: HeardDecision) -> None:
        self.decisions.append(d)
        self.stages[d.stage] += 1
        self.disagg.add(d)

