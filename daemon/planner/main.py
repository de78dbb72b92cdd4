"""The planner role: sizes the worker pools of one namespace and carries the sizes out.

``dynamod --role planner --planner load|sla [--mode disagg|agg] [--connector ...] [--dry-run]``.
Every adjustment interval it reads the pools (ready workers from discovery, their load reports on
``kv_metrics``) and, for the SLA planner, the frontends' traffic (their ``/metrics`` pages, or a
Prometheus server), asks the policy for each pool's size, lets an operator's ``dynamoctl scale``
override win, asks the connector to get there, and publishes each decision on
``planner_decisions``, its status at ``v1/planner/{ns}/status`` and ``dynamo_planner_*`` metrics.

The process registers as an instance of component ``planner`` (endpoint ``status``, which answers
with the current ``PlannerStatus``), so it shows in discovery, holds a lease (its status vanishes
with it) and serves ``/health`` and ``/metrics`` with ``--system-port``. SIGTERM: the pass in
progress finishes (bounded), then the planner leaves discovery and the event plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynamod.daemon.planner.config import PlannerDaemonConfig, add_daemon_args, daemon_config_from_args
from dynamod.daemon.planner.connectors.base import Connector
from dynamod.daemon.planner.connectors.factory import add_connector_args, create_connector
from dynamod.daemon.planner.load_watch import LoadWatch
from dynamod.daemon.planner.loop import LoopSettings, OverrideWatch, PlannerLoop
from dynamod.daemon.planner.metrics import PlannerMetrics
from dynamod.daemon.planner.policy import Observation, PlannerPolicy
from dynamod.daemon.planner.policy_args import add_policy_args, build_policy
from dynamod.daemon.planner.traffic import FrontendScrape, TrafficSource
from dynamod.shared.config import add_runtime_args, settings_from_args
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.events.plane import TOPIC_PLANNER_DECISIONS
from dynamod.shared.protocol.keys import (
    mdc_prefix,
    parse_key,
    planner_desired_key,
    planner_scaled_key,
    planner_status_key,
)
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.protocol.planner import (
    PLANNER_COMPONENT,
    DesiredReplicas,
    PlannerDecision,
    PlannerStatus,
    ScaledReplicas,
    decision_encoder,
)
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.model_cards import CardListener, ModelCardSet
from dynamod.shared.security.token import ClusterToken
from dynamod.shared.transport.plane import RequestContext

logger = logging.getLogger(__name__)

STATUS_ENDPOINT = "status"
STOP_GRACE_S = 5.0  # a pass in progress (a slow connector call) gets this long after SIGTERM


def add_args(parser: argparse.ArgumentParser) -> None:
    add_policy_args(parser)
    add_connector_args(parser.add_argument_group("planner connector"))
    add_daemon_args(parser)
    add_runtime_args(parser)


class Observer:
    """Builds one ``Observation``: the pools from the load watch, the traffic from its source. A
    traffic source that fails leaves ``traffic`` unknown for this interval (the SLA policy then
    holds) and is counted, never fatal."""

    def __init__(self, load: LoadWatch, traffic: TrafficSource | None, metrics: PlannerMetrics) -> None:
        self._load = load
        self._traffic = traffic
        self._metrics = metrics

    async def __call__(self, with_traffic: bool = True) -> Observation:
        traffic = None
        if with_traffic and self._traffic is not None:
            try:
                traffic = await self._traffic.sample()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - unknown traffic this interval, retried next
                self._metrics.source_errors.labels(self._traffic.name).inc()
                logger.warning("traffic source failed source=%s error=%s", self._traffic.name, exc)
        return Observation(now=time.monotonic(), pools=self._load.pools(), traffic=traffic)


def make_traffic_source(config: PlannerDaemonConfig, store: DiscoveryStore, namespace: str,
                        window_s: float, token: ClusterToken | None = None) -> TrafficSource | None:
    """The configured traffic source; the Prometheus window is the adjustment interval. ``token``:
    the cluster token, which the frontends' ``/metrics`` want from members."""
    if config.traffic_source == "off":
        return None
    if config.traffic_source == "prometheus":
        from dynamod.daemon.planner.prometheus import PrometheusTraffic

        return PrometheusTraffic(config.prometheus_url, window_s, model=config.model,
                                 extra_selector=config.prometheus_selector, timeout_s=config.scrape_timeout_s)
    return FrontendScrape(store, namespace, urls=list(config.metrics_urls), frontend_component=config.frontend_component,
                          model=config.model, timeout_s=config.scrape_timeout_s, token=token)


async def next_decision_id(store: DiscoveryStore, namespace: str) -> int:
    """One past the last id an orchestrator may have seen (``desired``/``scaled`` outlive the
    planner), so a restarted planner's decisions never look older than its predecessor's."""
    last = 0
    for key, kind in ((planner_desired_key(namespace), DesiredReplicas), (planner_scaled_key(namespace), ScaledReplicas)):
        raw = await store.get(key)
        if raw is None:
            continue
        try:
            last = max(last, msgspec.json.decode(raw, type=kind).decision_id)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed planner record key=%s error=%s", key, exc)
    return last + 1


def _model_card_listener(policy: PlannerPolicy, components: set[str]) -> CardListener:
    """Hands the workers' context length and block size to a policy that wants them (the load
    policy's prefill-queue ratio and KV demand); flags given on the command line win there."""
    set_model = getattr(policy, "set_model", None)

    def on_card(key: str, card: ModelCard | None) -> None:
        parsed = parse_key(key)
        if card is None or set_model is None or parsed is None or parsed.lora or parsed.component not in components:
            return
        set_model(context_length=card.context_length or None, kv_block_size=card.kv_block_size or None)

    return on_card


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    config = daemon_config_from_args(args)
    policy = build_policy(args)
    settings = settings_from_args(args)
    ns = settings.namespace
    runtime = await DistributedRuntime.create(settings)
    closers: list[Any] = []
    connector: Connector | None = None
    try:
        store = runtime.store
        metrics = PlannerMetrics(runtime.registry)
        metrics.interval.set(policy.interval_s)
        if not config.dry_run:
            connector = await create_connector(args, runtime)

        load = LoadWatch(runtime, worker_component=config.worker_component, prefill_component=config.prefill_component)
        closers.append(load.close)
        await load.start()
        cards = ModelCardSet(store, mdc_prefix(ns))
        cards.add_listener(_model_card_listener(policy, {config.worker_component, config.prefill_component}))
        closers.append(cards.close)
        await cards.start()
        traffic = make_traffic_source(config, store, ns, policy.interval_s, settings.security.request_plane.token)
        if traffic is not None:
            closers.append(traffic.close)
            await traffic.start()
        overrides = OverrideWatch(store, ns)
        closers.append(overrides.close)
        await overrides.start()

        component = runtime.namespace().component(PLANNER_COMPONENT)
        publisher = await component.publisher(TOPIC_PLANNER_DECISIONS)

        async def publish(decision: PlannerDecision) -> None:
            await publisher.publish(TOPIC_PLANNER_DECISIONS, decision_encoder.encode(decision))

        async def write_status(status: PlannerStatus) -> None:
            await store.put(planner_status_key(ns), msgspec.json.encode(status), runtime.lease)

        loop = PlannerLoop(
            policy,
            observe=Observer(load, traffic, metrics),
            overrides=overrides,
            publish=publish,
            write_status=write_status,
            connector=connector,
            settings=LoopSettings(namespace=ns, dry_run=config.dry_run, connector_name=getattr(args, "connector", ""),
                                  instance_id=runtime.instance_id),
            metrics=metrics,
            first_decision_id=await next_decision_id(store, ns),
        )
        await loop.start_connector()  # a ConfigError (bad inventory, no kubeconfig) stops here
        await loop.write_status()

        async def status_handler(_body: Any, _ctx: RequestContext) -> AsyncIterator[Any]:
            yield msgspec.to_builtins(loop.status())

        await component.endpoint(STATUS_ENDPOINT).serve(
            status_handler, role="planner",
            labels={"planner": policy.name, "connector": loop.connector_name, "dry_run": str(config.dry_run).lower()},
        )
        logger.info(
            "planner up instance_id=%016x planner=%s interval_s=%g connector=%s dry_run=%s traffic=%s status_url=%s",
            runtime.instance_id, policy.name, policy.interval_s, loop.connector_name or "-", config.dry_run,
            traffic.name if traffic is not None else "off", runtime.status_url or "off",
        )
        task = asyncio.create_task(loop.run(stop), name="planner-loop")
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), STOP_GRACE_S)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return 0
    finally:
        for close in reversed(closers):
            try:
                await close()
            except Exception as exc:  # noqa: BLE001 - keep closing the rest
                logger.warning("planner close failed error=%r", exc)
        if connector is not None:
            try:
                await connector.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("connector close failed error=%r", exc)
        await runtime.shutdown(grace_s=1.0)
        logger.info("planner stopped")
