"""The decode worker for a prompt prefilled on it (conditional disaggregation decided local): by time.

The KV router's cost, ``overlap_weight * prefill_blocks + decode_blocks`` (scheduler.py), prices a
queued short prefill at its blocks: a 100-token prompt routed to a worker a moment ago is 1.6
blocks there, against the 14-20 decode blocks each worker holds. When closed-loop chat streams
come back together (a bunch of requests within a few ms), every member goes to the worker with
the fewest decode blocks, and each waits there for the prefill step of the one before it
(measured live at 1P+3D: 43 % of the short prompts landed on a decode worker that got another
within 30 ms, and those took 44-50 ms to their first token against 30 ms alone).

For such a prompt the decode worker is what its prefill waits on, so the candidates are compared
in the cost policy's own unit, milliseconds (``disagg_cost.local_on_worker_ms``): the prefill
work queued there (routed, no first token yet) and this prompt's uncached tokens, each chunk
riding a decode step while decodes run there, plus the stall it puts on those decodes. Decode
blocks enter as what they cost in time: the decode step at the worker's KV occupancy. Ties keep
the KV router's order (its lowest key first).

Applied only to the decode stage of a prompt the policy keeps local: aggregated routing, the
prefill pool and remotely prefilled prompts keep the KV cost. It re-ranks the scheduler's scores,
so the compiled and the Python scheduler give the same choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.daemon.router.core.active_sequences import ActiveSequences
from dynamod.daemon.router.core.busy import BusyPolicy
from dynamod.daemon.router.core.disagg_cost import (
    DEFAULT_INTERFERENCE_WEIGHT,
    ComputeModel,
    local_on_worker_ms,
)
from dynamod.daemon.router.core.scheduler import Selection
from dynamod.shared.kv.indexer import WorkerKey
from dynamod.shared.protocol.routing import REASON_LOWEST_LOCAL_MS, CandidateScore


def queued_prefill_tokens(active: ActiveSequences, busy: BusyPolicy, worker: WorkerKey) -> int:
    """Prefill tokens waiting on ``worker``: the larger of its fresh report and the router's own
    count (requests routed a moment ago are not in the worker's last report yet)."""
    own = active.active_prefill_tokens(worker)
    latest = busy.latest(worker)
    return max(own, latest.active_prefill_tokens) if latest is not None else own


def running_decodes(active: ActiveSequences, busy: BusyPolicy, worker: WorkerKey) -> int:
    """Requests decoding on ``worker`` by the time a prompt routed now is prefilled there: the
    larger of its fresh report and the router's count of requests routed there, as
    ``queued_prefill_tokens``. Those routed since the report are prefilling now and decode by then
    (they are ahead of it); the report alone made a worker whose streams had just ended look idle
    to a whole burst, and the local-prefill choice sent 15 of 24 short prompts there (69-70 ms to
    their first token, against 27-37 on the others)."""
    load = active.load(worker)
    own = 0 if load is None else load.requests
    latest = busy.latest(worker)
    return max(latest.num_running, own) if latest is not None else own


def kv_capacity(busy: BusyPolicy, worker: WorkerKey) -> int:
    """``worker``'s KV blocks: its fresh report's total, else what the busy policy knows (0: unknown)."""
    latest = busy.latest(worker)
    return latest.total_blocks if latest is not None and latest.total_blocks else busy.capacity(worker)


@dataclass(frozen=True, slots=True)
class LocalPrefillChoice:
    """Picks the decode worker of a locally prefilled prompt by ``local_on_worker_ms``.
    ``compute``: the deployment's compute model (the cost policy's: a profile live, the mocker's
    timing in replay); ``interference_weight``: the policy's."""

    compute: ComputeModel
    interference_weight: float = DEFAULT_INTERFERENCE_WEIGHT

    def predicted_ms(
        self, scores: list[CandidateScore], isl: int, block_size: int, active: ActiveSequences, busy: BusyPolicy,
    ) -> list[float]:
        """Each candidate's predicted cost (ms), in ``scores`` order."""
        out: list[float] = []
        for s in scores:
            worker = (s.worker_id, s.dp_rank)
            capacity = kv_capacity(busy, worker)
            out.append(local_on_worker_ms(
                self.compute,
                tokens=max(isl - s.overlap_blocks * block_size, 0),
                queued_tokens=queued_prefill_tokens(active, busy, worker),
                running_decodes=running_decodes(active, busy, worker),
                kv_fraction=s.decode_blocks / capacity if capacity else 0.0,
                interference_weight=self.interference_weight,
            ))
        return out

    def select(
        self, scores: list[CandidateScore], keys: list[int], isl: int, block_size: int,
        active: ActiveSequences, busy: BusyPolicy,
    ) -> Selection:
        """The candidate with the lowest predicted ms (ties: the lowest KV key, then the first)."""
        ms = self.predicted_ms(scores, isl, block_size, active, busy)
        order = sorted(range(len(scores)), key=lambda i: (ms[i], keys[i]))
        i = order[0]
        if len(order) == 1:
            detail = f"local prefill: only candidate, predicted {ms[i]:.1f} ms"
        else:
            j = order[1]
            detail = (
                f"local prefill: lowest predicted {ms[i]:.1f} ms (kv cost {scores[i].cost:.3f}); "
                f"next {ms[j]:.1f} ms (worker {scores[j].worker_id:016x} dp {scores[j].dp_rank}, kv cost {scores[j].cost:.3f})"
            )
        return Selection(i, scores, REASON_LOWEST_LOCAL_MS, detail)
