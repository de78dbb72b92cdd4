"""The planner's loop: every adjustment interval, observe -> plan -> override -> act -> tell.

One pass (``tick``) builds the ``Observation``, asks the policy for each pool's size, lets an
operator's ``ScaleOverride`` win over the policy for its pool, asks the connector for the counts
(never under ``--dry-run``), and then tells everyone: one ``PlannerDecision`` per pool on the event
plane, the ``PlannerStatus`` in discovery, the ``dynamo_planner_*`` gauges and one log line per
decision. Everything after the policy is best effort: a connector, event-plane or discovery
failure is logged, counted and carried in the decision's ``error``, and the next interval simply
asks again (the connector's ``set_replicas`` is idempotent), so the planner never dies of an
unreachable orchestrator.

An override set or changed between intervals is carried out at once, without asking the policy:
the operator should not wait up to an SLA interval (minutes) for ``dynamoctl scale``, and calling
the policy off its interval would feed its predictors a short, skewed sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from dynamod.daemon.planner.connectors.base import Connector
from dynamod.daemon.planner.metrics import PlannerMetrics
from dynamod.daemon.planner.policy import Observation, PlannerPolicy, PoolObservation, PoolPlan, TrafficSample
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.keys import planner_override_prefix
from dynamod.shared.protocol.planner import (
    ACTION_HOLD,
    ACTION_SCALE_DOWN,
    ACTION_SCALE_UP,
    POOL_COMPONENT,
    POOLS,
    PlannerDecision,
    PlannerStatus,
    PoolStatus,
    ScaleOverride,
)
from dynamod.shared.runtime.watched_map import WatchedMap

logger = logging.getLogger(__name__)

REASON_OVERRIDE = "override"
REASON_POLICY_ERROR = "policy_error"

Observe = Callable[[bool], Awaitable[Observation]]
"""Builds the interval's observation; the argument says whether to sample traffic too (an
override-only pass must not, or the next interval's rates would cover only part of it)."""
PublishDecision = Callable[[PlannerDecision], Awaitable[None]]
WriteStatus = Callable[[PlannerStatus], Awaitable[None]]


class OverrideWatch:
    """The operator's ``ScaleOverride`` per pool (``v1/planner/{ns}/override/{pool}``), kept
    current by a discovery watch; ``changed`` is set whenever an override appears, changes or is
    cleared."""

    def __init__(self, store: DiscoveryStore, namespace: str) -> None:
        self._prefix = planner_override_prefix(namespace)
        self._current: dict[str, ScaleOverride] = {}
        self.changed = asyncio.Event()
        self._overrides: WatchedMap[ScaleOverride] = WatchedMap(store, self._prefix, self._decode, what="override")
        self._overrides.add_listener(self._on_change)

    def current(self) -> dict[str, ScaleOverride]:
        return dict(self._current)

    async def start(self) -> None:
        await self._overrides.start()
        self.changed.clear()  # what is there at start is read by the first pass anyway

    async def close(self) -> None:
        await self._overrides.close()

    def _decode(self, key: str, value: bytes) -> ScaleOverride:
        if key[len(self._prefix):] not in POOLS:
            raise ValueError(f"unknown pool; pools: {','.join(POOLS)}")
        override = msgspec.json.decode(value, type=ScaleOverride)
        if override.replicas < 0:
            raise ValueError(f"negative replicas {override.replicas}")
        return override

    def _on_change(self, key: str, override: ScaleOverride | None) -> None:
        pool = key[len(self._prefix):]
        if override is None:
            if self._current.pop(pool, None) is not None:
                logger.info("override cleared pool=%s", pool)
                self.changed.set()
        elif self._current.get(pool) != override:
            self._current[pool] = override
            logger.info("override set pool=%s replicas=%d set_by=%s reason=%s", pool, override.replicas,
                        override.set_by or "-", override.reason or "-")
            self.changed.set()


@dataclass(frozen=True, slots=True)
class LoopSettings:
    namespace: str
    dry_run: bool = False
    connector_name: str = ""  # for the decisions; the connector's own name wins when there is one
    instance_id: int = 0


def action_for(current: int, desired: int) -> str:
    if desired > current:
        return ACTION_SCALE_UP
    if desired < current:
        return ACTION_SCALE_DOWN
    return ACTION_HOLD


_UNLIMITED = 1 << 30


def _bounds(policy: PlannerPolicy, pool: str) -> tuple[int, int]:
    """The pool's replica budget as the policy knows it (``bounds(pool)``, or its config's
    ``budget.min_for/max_for``); 0 for an unknown or unlimited bound."""
    try:
        bounds = getattr(policy, "bounds", None)
        if callable(bounds):
            lo, hi = bounds(pool)
            return int(lo), int(hi)
        budget = getattr(getattr(policy, "config", None), "budget", None)
        if budget is not None and hasattr(budget, "min_for") and hasattr(budget, "max_for"):
            hi = int(budget.max_for(pool))
            return int(budget.min_for(pool)), 0 if hi >= _UNLIMITED else hi
    except Exception:  # noqa: BLE001 - bounds only annotate a decision
        logger.debug("policy bounds unavailable pool=%s", pool, exc_info=True)
    return 0, 0


def _targets(policy: PlannerPolicy) -> dict[str, float]:
    """The SLA targets (``ttft_ms``, ``itl_ms``) of a policy that has them (its config's)."""
    config = getattr(policy, "config", None)
    out: dict[str, float] = {}
    for key in ("ttft_ms", "itl_ms"):
        value = getattr(policy, key, None)
        if value is None:
            value = getattr(config, key, None)
        if isinstance(value, int | float):
            out[key] = float(value)
    return out


class PlannerLoop:
    def __init__(
        self,
        policy: PlannerPolicy,
        *,
        observe: Observe,
        overrides: OverrideWatch,
        publish: PublishDecision,
        write_status: WriteStatus,
        connector: Connector | None,
        settings: LoopSettings,
        metrics: PlannerMetrics | None = None,
        first_decision_id: int = 1,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._policy = policy
        self._observe = observe
        self._overrides = overrides
        self._publish = publish
        self._write_status = write_status
        self._connector = connector
        self._connector_started = False
        self._start_error = ""
        self._settings = settings
        self._metrics = metrics
        self._next_id = first_decision_id
        self._clock = wall_clock
        self._requested: dict[str, int] = {}  # what the connector last accepted, per pool
        self._desired: dict[str, int] = {}  # what the planner last decided, per pool
        self._pool_status: dict[str, PoolStatus] = {}
        self._predicted: dict[str, float] = {}
        self._observed: dict[str, float] = {}  # the last planned interval's traffic (status only)
        self.last_decisions: list[PlannerDecision] = []

    @property
    def connector_name(self) -> str:
        return self._connector.name if self._connector is not None else self._settings.connector_name

    # -- the schedule -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Decides every ``policy.interval_s`` (first after one interval, so rate sources have a
        baseline), and at once when an override changes, until ``stop`` is set."""
        loop = asyncio.get_running_loop()
        interval = float(self._policy.interval_s)
        next_at = loop.time() + interval
        while not stop.is_set():
            await _wait_any((stop, self._overrides.changed), max(0.0, next_at - loop.time()))
            if stop.is_set():
                return
            if self._overrides.changed.is_set():
                self._overrides.changed.clear()
                await self._guarded(plan=False)
                continue
            if loop.time() < next_at:
                continue
            next_at += interval
            if next_at <= loop.time():  # a pass overran: skip the missed slots, keep the phase
                next_at = loop.time() + interval
            await self._guarded(plan=True)

    async def _guarded(self, *, plan: bool) -> None:
        try:
            await self.tick(plan=plan)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad pass must not end the planner
            logger.exception("planner pass failed; next interval retries")

    async def start_connector(self) -> None:
        """Connects the connector unless dry-run. A ConfigError is the operator's to fix and
        propagates; anything else (the orchestrator briefly unreachable) is retried each pass."""
        if self._settings.dry_run or self._connector is None or self._connector_started:
            return
        try:
            await self._connector.start()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried before the next set_replicas
            self._start_error = f"connector start failed: {type(exc).__name__}: {exc}"
            logger.warning("connector start failed connector=%s error=%r; retrying next interval", self.connector_name, exc)
            return
        self._connector_started = True

    # -- one pass ---------------------------------------------------------------------------------

    async def tick(self, *, plan: bool = True) -> list[PlannerDecision]:
        """One pass. ``plan=False``: only carry out overrides that differ from what was last
        decided (the override-changed path); returns no decisions when there is none."""
        obs = await self._observe(plan)
        if self._metrics is not None:
            self._metrics.observed(obs)
        overrides = self._overrides.current()
        plans: dict[str, PoolPlan] = {}
        if plan:
            try:
                plans = self._policy.plan(obs)
            except Exception:  # noqa: BLE001 - a policy bug holds the fleet rather than stopping the planner
                logger.exception("policy failed policy=%s; holding", self._policy.name)
                plans = {
                    pool: PoolPlan(pool=pool, desired=p.ready, reason=REASON_POLICY_ERROR, detail="the policy raised; see the planner log")
                    for pool, p in obs.pools.items() if p.ready or pool in self._desired
                }
            pools = sorted(set(plans) | set(overrides), key=_pool_order)
        else:
            pools = sorted((p for p, o in overrides.items() if self._desired.get(p) != o.replicas), key=_pool_order)
        if not pools:
            return []
        decision_id = self._next_id
        self._next_id += 1
        decisions = [self._decide(decision_id, pool, obs, plans.get(pool), overrides.get(pool)) for pool in pools]
        decisions = await self._act(decision_id, decisions)
        for d in decisions:
            await self._tell(d)
        await self._update_status(decisions, obs if plan else None)
        self.last_decisions = decisions
        return decisions

    def _decide(self, decision_id: int, pool: str, obs: Observation, plan: PoolPlan | None,
                override: ScaleOverride | None) -> PlannerDecision:
        observed = obs.pools.get(pool)
        current = observed.ready if observed is not None else 0
        lo, hi = _bounds(self._policy, pool)
        if override is not None:
            desired = override.replicas
            action = action_for(current, desired)
            reason = REASON_OVERRIDE
            who = f" set_by={override.set_by}" if override.set_by else ""
            why = f" ({override.reason})" if override.reason else ""
            policy_said = f"; policy wanted {plan.desired} ({plan.reason})" if plan is not None else ""
            detail = f"operator override: {desired} replicas{who}{why}{policy_said}"
        else:
            assert plan is not None
            desired, action, reason, detail = plan.desired, plan.action, plan.reason, plan.detail
        return PlannerDecision(
            decision_id=decision_id,
            ts=self._clock(),
            namespace=self._settings.namespace,
            planner=self._policy.name,
            pool=pool,
            component=POOL_COMPONENT.get(pool, pool),
            current=current,
            desired=desired,
            action=action,
            reason=reason,
            detail=detail,
            inputs=dict(plan.inputs) if plan is not None else {},
            predicted=dict(plan.predicted) if plan is not None else {},
            targets=_targets(self._policy),
            min_replicas=lo,
            max_replicas=hi,
            override=override.replicas if override is not None else None,
            dry_run=self._settings.dry_run,
            connector=self.connector_name,
        )

    async def _act(self, decision_id: int, decisions: list[PlannerDecision]) -> list[PlannerDecision]:
        """Asks the connector for every decided pool's count (idempotent, so a pending scale-up
        keeps its target and a failed call is simply asked again next pass)."""
        if self._settings.dry_run or self._connector is None:
            return decisions
        desired = {d.pool: d.desired for d in decisions}
        error = ""
        try:
            await self.start_connector()
            if not self._connector_started:
                raise ConnectionError(self._start_error or "the connector is not started")
            await self._connector.set_replicas(desired, decision_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - published in the decision, retried next interval
            error = f"{type(exc).__name__}: {exc}"
            if self._metrics is not None:
                self._metrics.connector_errors.inc()
            logger.warning("connector failed connector=%s decision_id=%d desired=%s error=%s; retrying next interval",
                           self.connector_name, decision_id, desired, error)
        out = []
        for d in decisions:
            changed = d.action != ACTION_HOLD or self._requested.get(d.pool) != d.desired
            acted = not error and changed
            out.append(msgspec.structs.replace(d, acted=acted, error=error))
        if not error:
            self._requested.update(desired)
        return out

    async def _tell(self, d: PlannerDecision) -> None:
        self._desired[d.pool] = d.desired
        if d.predicted:
            self._predicted = dict(d.predicted)
        if self._metrics is not None:
            self._metrics.decided(d)
        logger.info(
            "planner decision id=%d pool=%s current=%d desired=%d action=%s reason=%s override=%s dry_run=%s acted=%s%s detail=%s",
            d.decision_id, d.pool, d.current, d.desired, d.action, d.reason,
            "-" if d.override is None else d.override, d.dry_run, d.acted,
            f" error={d.error!r}" if d.error else "", d.detail or "-",
        )
        try:
            await self._publish(d)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the decision is still logged and acted on
            logger.warning("decision publish failed decision_id=%d pool=%s error=%r", d.decision_id, d.pool, exc)

    def status(self) -> PlannerStatus:
        return PlannerStatus(
            namespace=self._settings.namespace,
            planner=self._policy.name,
            connector=self.connector_name,
            interval_s=float(self._policy.interval_s),
            dry_run=self._settings.dry_run,
            targets=_targets(self._policy),
            pools=dict(self._pool_status),
            predicted=dict(self._predicted),
            last_decision_id=self._next_id - 1,
            ts=self._clock(),
            instance_id=self._settings.instance_id,
            observed=dict(self._observed),
        )

    async def _update_status(self, decisions: list[PlannerDecision], obs: Observation | None = None) -> None:
        """``obs``: the planned interval's observation, whose live figures (traffic, each pool's
        load) the status carries for the console and ``dynamoctl``; None on an override-only
        pass, which keeps the last ones."""
        if obs is not None:
            self._observed = observed_traffic(obs.traffic)
        for d in decisions:
            observed = obs.pools.get(d.pool) if obs is not None else None
            old = self._pool_status.get(d.pool)
            self._pool_status[d.pool] = PoolStatus(
                component=d.component, current=d.current, desired=d.desired,
                min_replicas=d.min_replicas, max_replicas=d.max_replicas, override=d.override,
                load=pool_load(observed) if observed is not None else (dict(old.load) if old is not None else {}),
                action=d.action, reason=d.reason,
            )
        await self.write_status()

    async def write_status(self) -> None:
        try:
            await self._write_status(self.status())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - discovery briefly away: the next pass writes again
            logger.warning("planner status write failed error=%r", exc)


# -- live figures for the status record (what the console and dynamoctl show) --------------------


def observed_traffic(sample: TrafficSample | None) -> dict[str, float]:
    """The interval's traffic as ``PlannerStatus.observed``: arrivals per second and the means
    that were measured (a figure nothing measured is left out, not shown as 0)."""
    if sample is None:
        return {}
    out: dict[str, float] = {}
    if sample.duration_s > 0:
        out["request_rate"] = max(0.0, sample.num_requests) / sample.duration_s
    for key in ("isl", "osl", "ttft_ms", "itl_ms"):
        value = getattr(sample, key)
        if value is not None:
            out[key] = float(value)
    return out


def pool_load(pool: PoolObservation) -> dict[str, float]:
    """A pool's load as ``PoolStatus.load``: queued and running requests summed over its workers,
    the fullest worker's KV share; empty when no worker reported."""
    if not pool.loads:
        return {}
    return {
        "waiting": float(sum(w.num_waiting for w in pool.loads)),
        "running": float(sum(w.num_running for w in pool.loads)),
        "kv_usage": max(w.kv_usage for w in pool.loads),
    }


def _pool_order(pool: str) -> int:
    return POOLS.index(pool) if pool in POOLS else len(POOLS)


async def _wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Returns when any of ``events`` is set or ``timeout`` seconds passed."""
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
