"""Standalone KV router: ``generate`` and ``best_worker_id`` on ``{namespace}/router``.

``dynamod --role router [--router-component router] [--worker-component backend]``: for setups
with several frontends or pools that should share one KV-aware view of the workers (or, with
``--router-replica-sync``, several router replicas that share their active requests). It follows
the worker component's ready ``generate`` instances, their KV events, load and ``kv_dump`` exactly
as the frontend's kv mode does, and publishes its decisions on ``router_decisions``.

Shutdown (SIGTERM/SIGINT): the endpoints are deregistered at once, streams in flight run to their
end (up to ``--shutdown-grace``), then the router leaves the event plane and discovery.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from dynamod.daemon.router.core.config import add_router_args, config_from_args
from dynamod.daemon.router.core.decision_publisher import add_decision_args, sample_rate_from_args
from dynamod.daemon.router.core.disagg_policy import add_disagg_args, disagg_config_from_args
from dynamod.daemon.router.core.prefill_stage import DEFAULT_PREFILL_TIMEOUT_S, DisaggMetrics, PrefillStage
from dynamod.daemon.router.service import RouterService, RouterServiceConfig
from dynamod.shared.config import add_runtime_args, env_or, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)



def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router")
    g.add_argument("--router-component", default=env_or("DYN_ROUTER_COMPONENT", "router"),
                   help="component this router serves generate/best_worker_id on [env DYN_ROUTER_COMPONENT, default router]")
    g.add_argument("--worker-component", default=env_or("DYN_WORKER_COMPONENT", "backend"),
                   help="component of the workers routed to [env DYN_WORKER_COMPONENT, default backend]")
    g.add_argument("--prefill-component", default=env_or("DYN_PREFILL_COMPONENT", "prefill"),
                   help="component of the prefill workers; '' turns disaggregated serving off "
                   "[env DYN_PREFILL_COMPONENT, default prefill]")
    g.add_argument("--prefill-timeout", type=float, default=float(env_or("DYN_PREFILL_TIMEOUT", str(DEFAULT_PREFILL_TIMEOUT_S))),
                   help="seconds a remote prefill may take to return its transfer parameters before another prefill "
                   f"worker (then local prefill) is tried [env DYN_PREFILL_TIMEOUT, default {DEFAULT_PREFILL_TIMEOUT_S:g}]")
    g.add_argument("--kv-block-size", type=int, default=None,
                   help="tokens per KV block [default: from the workers' model cards]")
    g.add_argument("--worker-wait", type=float, default=5.0,
                   help="seconds a request waits for a ready worker before failing [default 5]")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds streams in flight may run after SIGTERM [default 30]")
    add_runtime_args(parser)
    add_router_args(parser)
    add_decision_args(parser)
    add_disagg_args(parser)


def service_config_from_args(args: argparse.Namespace) -> RouterServiceConfig:
    if args.kv_block_size is not None and args.kv_block_size <= 0:
        raise ConfigError(f"--kv-block-size must be positive, got {args.kv_block_size}")
    if args.worker_wait < 0:
        raise ConfigError("--worker-wait must be 0 or more")
    if args.router_component == args.worker_component:
        raise ConfigError("--router-component and --worker-component must differ")
    if args.prefill_component and args.prefill_component in (args.router_component, args.worker_component):
        raise ConfigError("--prefill-component must differ from --router-component and --worker-component")
    if args.prefill_timeout <= 0:
        raise ConfigError("--prefill-timeout must be > 0")
    return RouterServiceConfig(
        router_component=args.router_component,
        worker_component=args.worker_component,
        prefill_component=args.prefill_component or None,
        block_size=args.kv_block_size,
        worker_wait_s=args.worker_wait,
        decision_sample_rate=sample_rate_from_args(args),
    )


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    kv_config = config_from_args(args)
    config = service_config_from_args(args)
    settings = settings_from_args(args)
    runtime = await DistributedRuntime.create(settings)
    service: RouterService | None = None
    try:
        busy = kv_config.active_prefill_tokens_threshold
        stage = PrefillStage(
            disagg_config_from_args(args), DisaggMetrics(runtime.registry, "dynamo_router"),
            prefill_timeout_s=args.prefill_timeout, busy_threshold=None if busy is None else float(busy),
        )
        service = RouterService(runtime, kv_config, config, stage)
        await service.start()
        logger.info(
            "router up instance_id=%016x replica_sync=%s use_kv_events=%s status_url=%s",
            runtime.instance_id, kv_config.router_replica_sync, kv_config.use_kv_events, runtime.status_url or "off",
        )
        await stop.wait()
        return 0
    finally:
        if service is not None:
            await service.stop(args.shutdown_grace)
        await runtime.shutdown(grace_s=1.0)
        logger.info("router stopped")
