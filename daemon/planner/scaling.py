"""From each pool's needs to its plan: bounds, start-up hysteresis, and the GPU budget counted with
the workers still starting or draining.

Both policies end here (``PoolSizer.plan``): the largest need of a pool (``reactive.strongest``) is
clamped to the pool's min/max, passed through the ``ScaleGuard`` (up at once, down only after the
release window; the window remembers the sustained needs and the hold-only ones, a burst onset's
carried rate, which hold a fleet but never grow it), then the pools are fitted into
``--max-gpu-budget``:

- the answer's total fits the budget (Dynamo's ``scale = budget / total`` rule, ``fit_total``);
- a pool grows only into GPUs free *now*: ready, starting and draining workers all hold theirs
  until they stop, so a P/D rebalance first drains one pool and grows the other on a later
  interval, never passing the budget even for the seconds a drain takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.daemon.planner.budget import ReplicaBudget
from dynamod.daemon.planner.hysteresis import ScaleGuard
from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan
from dynamod.daemon.planner.reactive import Need, strongest
from dynamod.shared.protocol.planner import ACTION_HOLD, ACTION_SCALE_DOWN, ACTION_SCALE_UP, POOL_PREFILL


@dataclass(slots=True)
class _Pending:
    target: int
    since: float


def action_of(committed: int, desired: int) -> str:
    """Against what was already asked for: holding a pending scale-up is a hold, not a new one."""
    return ACTION_SCALE_UP if desired > committed else ACTION_SCALE_DOWN if desired < committed else ACTION_HOLD


class PoolSizer:
    """Keeps per pool the change it asked for (live observations do not count starting workers:
    the pending target stands in for them for at most ``grace_s``) and the ``ScaleGuard``."""

    def __init__(self, budget: ReplicaBudget, *, interval_s: float, window_s: float, grace_s: float) -> None:
        self.budget = budget
        self.guard = ScaleGuard(window_s=window_s, interval_s=interval_s)
        self.grace_s = grace_s
        self._pending: dict[str, _Pending] = {}

    def committed(self, pool: str, obs: PoolObservation, now: float) -> tuple[int, bool]:
        """Replicas asked for and not given up, and whether a pending change stands in for
        workers the observation does not show (the live planner's grace period)."""
        have = obs.ready + obs.starting
        pending = self._pending.get(pool)
        if pending is None:
            return have, False
        if obs.ready == pending.target or now - pending.since >= self.grace_s:
            del self._pending[pool]
            return have, False
        if obs.starting or have == pending.target:
            return have, False
        return pending.target, True

    def plan(self, observation: Observation, needs: dict[str, list[Need]], committed: dict[str, int],
             pending: dict[str, bool], predicted: dict[str, float] | None = None) -> dict[str, PoolPlan]:
        now = observation.now
        plans: dict[str, PoolPlan] = {}
        for pool, pool_needs in needs.items():
            pobs = observation.pools.get(pool) or PoolObservation(pool, 0)
            top = strongest(pool_needs)
            lo, hi = self.budget.min_for(pool), self.budget.max_for(pool)
            want, reason, detail = top.replicas, top.reason, top.detail
            inputs = dict(top.inputs, need=float(top.replicas), committed=float(committed[pool]))
            if pobs.ready + pobs.starting < lo and want <= lo:
                plans[pool] = PoolPlan(pool, lo, action_of(committed[pool], lo), "below_min",
                                       f"{pobs.ready} ready, minimum {lo}", inputs, dict(predicted or {}))
                self.guard.decide(pool, now=now, ready=pobs.ready, committed=committed[pool], need=lo)
                continue
            if want < lo:
                want, reason, detail = lo, "at_min", f"{top.reason}: {top.detail}; minimum {lo}"
            elif want > hi:
                want, reason, detail = hi, "at_max_budget", f"{top.reason} asked {top.replicas}, at most {hi}: {top.detail}"
            sustained = [n.replicas for n in pool_needs if not n.transient and not n.hold_only]
            evidence = min(min(max(max(sustained, default=lo), lo), hi), want)
            # A hold-only need is evidence beyond what is wanted now: it may hold the fleet, never grow it.
            held = max((n.replicas for n in pool_needs if n.hold_only), default=0)
            g = self.guard.decide(pool, now=now, ready=pobs.ready, committed=committed[pool], need=want,
                                  evidence=max(evidence, min(held, hi)))
            inputs["window_need"] = float(g.window_need)
            if g.held:
                reason = "grace_period" if pending.get(pool) and g.reason == "scale_up_in_progress" else g.reason
                detail = f"{g.detail} (now: {top.reason}, {detail})"
            elif g.desired != want:
                detail = f"{g.detail}; now {top.reason}: {detail}"
            elif g.desired == committed[pool] and pending.get(pool):
                reason = "grace_period"
                detail = f"waiting for {committed[pool]} ready (have {pobs.ready}): {detail}"
            desired = g.desired
            plans[pool] = PoolPlan(pool, desired, action_of(committed[pool], desired), reason, detail, inputs,
                                   dict(predicted or {}))
        plans = self._fit_budget(plans, observation, committed)
        for pool, plan in plans.items():
            if plan.desired != committed[pool]:
                self._pending[pool] = _Pending(plan.desired, now)
        return plans

    def _fit_budget(self, plans: dict[str, PoolPlan], observation: Observation,
                    committed: dict[str, int]) -> dict[str, PoolPlan]:
        budget = self.budget
        if budget.max_gpu_budget <= 0:
            return plans
        out = dict(plans)
        counts = {p: pl.desired for p, pl in out.items()}
        fitted = budget.fit_total(counts)
        for pool, n in fitted.items():
            if n != counts[pool]:
                out[pool] = _budget_plan(out[pool], n, committed[pool],
                                         f"the pools' total {budget.gpus(counts)} GPUs exceeds the budget {budget.max_gpu_budget}")
        # GPUs held now: ready, starting (or pending) and draining workers.
        held = 0
        for pool in out:
            pobs = observation.pools.get(pool) or PoolObservation(pool, 0)
            held += (max(committed[pool], pobs.ready + pobs.starting) + pobs.draining) * budget.gpus_for(pool)
        # A shrinking pool frees nothing until its workers stop: they stay in ``held``.
        free = budget.max_gpu_budget - held
        growing = sorted((p for p, pl in out.items() if pl.desired > committed[p]),
                         key=lambda p: (p != POOL_PREFILL and out[p].reason != "ttft_miss", p))
        for pool in growing:
            plan = out[pool]
            per = budget.gpus_for(pool)
            room = max(0, free // per)
            grow = plan.desired - committed[pool]
            if grow > room:
                pobs = observation.pools.get(pool) or PoolObservation(pool, 0)
                n = committed[pool] + room
                out[pool] = _budget_plan(plan, n, committed[pool],
                                         f"{free} of {budget.max_gpu_budget} GPUs free now ({pobs.draining} draining, "
                                         f"{pobs.starting} starting in this pool)")
                grow = room
            free -= grow * per
        return out


def _budget_plan(plan: PoolPlan, desired: int, committed: int, why: str) -> PoolPlan:
    detail = f"{plan.reason} asked {plan.desired}, budget allows {desired} ({why}): {plan.detail}"
    return PoolPlan(plan.pool, desired, action_of(committed, desired), "at_max_budget", detail, dict(plan.inputs),
                    dict(plan.predicted))
