"""Global router: picks a pool (namespace) per request from Dynamo's grid config and forwards to it.

``dynamod --role global-router --config grid.json [--namespace dynamo]``: registers in its
namespace as a worker of the pools' model (``global_router/generate`` in agg mode,
``prefill_generate`` + ``decode_generate`` in disagg mode), so an ordinary frontend in that
namespace routes to it; each request goes to the router of the pool its input length and SLA
targets (``nvext.router.ttft_target`` / ``itl_target`` in ms, else ``--default-*-target-ms``, else
the middle of the configured range) select, or the pool its ``nvext.agent_hints.priority`` overrides
to, and, with ``enable_priority_retry``, to faster pools when that pool fails before its first output.

Shutdown (SIGTERM/SIGINT): the endpoints and the model cards leave discovery at once, streams in
flight run to their end (up to ``--shutdown-grace``), then the process leaves discovery.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from dynamod.daemon.global_router.config import load_config
from dynamod.daemon.global_router.service import GlobalRouterService, GlobalRouterServiceConfig
from dynamod.shared.config import add_runtime_args, env_or, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)


def _optional_float(env: str) -> float | None:
    value = env_or(env, "")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{env} must be a number of milliseconds, got {value!r}") from None


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("global router")
    g.add_argument("--config", dest="config_path", default=env_or("DYN_GLOBAL_ROUTER_CONFIG", ""),
                   help="grid config file (Dynamo's JSON format; .yaml/.yml read as YAML); required "
                   "[env DYN_GLOBAL_ROUTER_CONFIG]")
    g.add_argument("--model-name", default=env_or("DYN_GLOBAL_ROUTER_MODEL_NAME", ""),
                   help="served model name to register, as the pools' workers publish it "
                   "[env DYN_GLOBAL_ROUTER_MODEL_NAME, default: the first model a pool publishes]")
    g.add_argument("--component-name", default=env_or("DYN_GLOBAL_ROUTER_COMPONENT_NAME", "global_router"),
                   help="component the global router serves in its namespace "
                   "[env DYN_GLOBAL_ROUTER_COMPONENT_NAME, default global_router]")
    g.add_argument("--pool-component", default=env_or("DYN_GLOBAL_ROUTER_POOL_COMPONENT", "router"),
                   help="component requests go to in each pool namespace: the pool's router, or e.g. backend "
                   "to round-robin over its workers [env DYN_GLOBAL_ROUTER_POOL_COMPONENT, default router]")
    g.add_argument("--default-ttft-target-ms", type=float, default=None,
                   help="TTFT target (ms) for requests without nvext.router.ttft_target "
                   "[env DYN_GLOBAL_ROUTER_DEFAULT_TTFT_TARGET_MS, default: the middle of the config's TTFT range]")
    g.add_argument("--default-itl-target-ms", type=float, default=None,
                   help="ITL target (ms) for requests without nvext.router.itl_target "
                   "[env DYN_GLOBAL_ROUTER_DEFAULT_ITL_TARGET_MS, default: the middle of the config's ITL range]")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds streams in flight may run after SIGTERM [default 30]")
    add_runtime_args(parser)


def service_config_from_args(args: argparse.Namespace) -> GlobalRouterServiceConfig:
    ttft = args.default_ttft_target_ms
    if ttft is None:
        ttft = _optional_float("DYN_GLOBAL_ROUTER_DEFAULT_TTFT_TARGET_MS")
    itl = args.default_itl_target_ms
    if itl is None:
        itl = _optional_float("DYN_GLOBAL_ROUTER_DEFAULT_ITL_TARGET_MS")
    for flag, value in (("--default-ttft-target-ms", ttft), ("--default-itl-target-ms", itl)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be 0 or more, got {value:g}")
    return GlobalRouterServiceConfig(
        component=args.component_name,
        pool_component=args.pool_component,
        model_name=args.model_name or None,
        default_ttft_target_ms=ttft,
        default_itl_target_ms=itl,
    )


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    if not args.config_path:
        raise ConfigError("--config (or DYN_GLOBAL_ROUTER_CONFIG) is required: the grid config file")
    grid = load_config(args.config_path)
    config = service_config_from_args(args)
    settings = settings_from_args(args)
    grid.check_own_namespace(settings.namespace)
    runtime = await DistributedRuntime.create(settings, events=False)
    service: GlobalRouterService | None = None
    try:
        service = GlobalRouterService(runtime, grid, config)
        await service.start()
        logger.info("global router up instance_id=%016x status_url=%s", runtime.instance_id, runtime.status_url or "off")
        await stop.wait()
        return 0
    finally:
        if service is not None:
            await service.stop(args.shutdown_grace)
        await runtime.shutdown(grace_s=1.0)
        logger.info("global router stopped")
