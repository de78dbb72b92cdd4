"""OpenAI-compatible HTTP frontend: discovers models, preprocesses, routes, migrates, streams.

``dynamod --role frontend [--http-port 8000] [--router-mode round-robin|random|kv]``. Models appear
as workers publish their cards (no model flag here). ``--num-frontends N`` runs N processes on one
port (``SO_REUSEPORT``) that share routing state over the event plane.

Shutdown (SIGTERM/SIGINT): ``/health`` turns 503 and new requests get 503 at once, streams already
admitted run to their end (up to ``--shutdown-grace``), then the server and runtime close.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from dynamod.daemon.frontend.app import build_app
from dynamod.daemon.frontend.dispatch import Dispatcher
from dynamod.daemon.frontend.fleet import FrontendFleet
from dynamod.daemon.frontend.metrics import FrontendMetrics
from dynamod.daemon.frontend.models import ModelRegistry
from dynamod.daemon.frontend.router_factory import RouterFactoryBuilder, add_kv_router_args
from dynamod.daemon.frontend.routing import ROUTER_MODES, Quarantine
from dynamod.daemon.frontend.server import HttpServer, bind_socket
from dynamod.daemon.frontend.state import FrontendConfig, FrontendState
from dynamod.daemon.frontend.sync import RoutingSync
from dynamod.daemon.router.disagg_policy import add_disagg_args, disagg_config_from_args
from dynamod.daemon.router.prefill_stage import DEFAULT_PREFILL_TIMEOUT_S, DisaggMetrics, PrefillStage
from dynamod.shared.config import add_runtime_args, env_or, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)



def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("frontend")
    g.add_argument("--http-host", default=env_or("DYN_HTTP_HOST", "127.0.0.1"),
                   help="address the HTTP server binds [env DYN_HTTP_HOST, default 127.0.0.1]")
    g.add_argument("--http-port", type=int, default=int(env_or("DYN_HTTP_PORT", "8000")),
                   help="HTTP port; 0 = any free port [env DYN_HTTP_PORT, default 8000]")
    g.add_argument("--router-mode", choices=ROUTER_MODES, default=env_or("DYN_ROUTER_MODE", "round-robin"),
                   help="how workers are chosen [env DYN_ROUTER_MODE, default round-robin]")
    g.add_argument("--migration-limit", type=int, default=None,
                   help="times a broken stream may move to another worker [default: the model card's, 3]")
    g.add_argument("--worker-wait", type=float, default=5.0,
                   help="seconds a request waits for a ready worker before a 503 [default 5]")
    g.add_argument("--max-inflight", type=int, default=4096,
                   help="requests admitted at once; more get 503 with Retry-After [default 4096]")
    g.add_argument("--token-coalesce-ms", type=float, default=0.0,
                   help="merge tokens arriving within this many ms into one SSE chunk [default 0: off]")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds admitted requests may run after SIGTERM [default 30]")
    g.add_argument("--num-frontends", type=int, default=1,
                   help="frontend processes sharing the HTTP port (SO_REUSEPORT) [default 1]")
    g.add_argument("--frontend-group-pid", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--reuse-port", action="store_true",
                   help="share the HTTP port with other frontend processes started separately (SO_REUSEPORT), "
                        "as `dynamod up --num-frontends N` does; they share routing state like a fleet")
    add_prefill_timeout_arg(g)
    add_runtime_args(parser)
    add_kv_router_args(parser)
    add_disagg_args(parser)


def add_prefill_timeout_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--prefill-timeout", type=float, default=float(env_or("DYN_PREFILL_TIMEOUT", str(DEFAULT_PREFILL_TIMEOUT_S))),
        help="seconds a remote prefill may take to return its transfer parameters before another prefill worker "
        f"(then local prefill) is tried [env DYN_PREFILL_TIMEOUT, default {DEFAULT_PREFILL_TIMEOUT_S:g}]",
    )


def prefill_stage_from_args(args: argparse.Namespace, metrics: DisaggMetrics) -> PrefillStage:
    """The prefill stage with its policy flags; the busy threshold defaults to the KV router's
    ``--active-prefill-tokens-threshold`` (a prefill worker's load is its active prefill tokens)."""
    if args.prefill_timeout <= 0:
        raise ConfigError("--prefill-timeout must be > 0")
    busy = getattr(args, "active_prefill_tokens_threshold", None)
    return PrefillStage(
        disagg_config_from_args(args), metrics, prefill_timeout_s=args.prefill_timeout,
        busy_threshold=None if busy is None else float(busy),
    )


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    if args.num_frontends < 1:
        raise ConfigError("--num-frontends must be at least 1")
    if args.migration_limit is not None and args.migration_limit < 0:
        raise ConfigError("--migration-limit must be 0 or more")
    if args.max_inflight < 1:
        raise ConfigError("--max-inflight must be at least 1")
    if args.worker_wait < 0:
        raise ConfigError("--worker-wait must be 0 or more")
    return FrontendConfig(
        http_host=args.http_host,
        http_port=args.http_port,
        router_mode=args.router_mode,
        migration_limit=args.migration_limit if args.migration_limit is not None else -1,
        worker_wait_s=args.worker_wait,
        max_inflight=args.max_inflight,
        coalesce_s=max(0.0, args.token_coalesce_ms) / 1000.0,
        shutdown_grace_s=args.shutdown_grace,
        num_frontends=args.num_frontends,
    )


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    config = config_from_args(args)
    settings = settings_from_args(args)
    runtime = await DistributedRuntime.create(settings)
    sync: RoutingSync | None = None
    registry: ModelRegistry | None = None
    server: HttpServer | None = None
    fleet: FrontendFleet | None = None
    routers: RouterFactoryBuilder | None = None
    try:
        metrics = FrontendMetrics(runtime.registry)
        quarantine = Quarantine(hold_s=settings.lease_ttl_s + 1.0)
        sync = RoutingSync(runtime, quarantine)
        routers = RouterFactoryBuilder(config.router_mode, args, runtime, sync)
        registry = ModelRegistry(runtime, metrics, quarantine, routers.build, routers.build_prefill)
        routers.attach(registry)
        dispatcher = Dispatcher(
            registry, quarantine, migration_limit=config.migration_limit, worker_wait_s=config.worker_wait_s,
            prefill_stage=prefill_stage_from_args(args, metrics.disagg),
        )
        dispatcher.on_worker_down = sync.publish_worker_down
        state = FrontendState(config=config, registry=registry, dispatcher=dispatcher, metrics=metrics)
        await sync.start()
        await routers.start()
        await registry.start()
        # Only a fleet shares its port: a second, unrelated frontend on a taken port must fail.
        reuse_port = config.num_frontends > 1 or args.frontend_group_pid is not None or args.reuse_port
        try:
            sock = bind_socket(config.http_host, config.http_port, reuse_port=reuse_port)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {config.http_host}:{config.http_port}: {exc.strerror or exc}; pick another --http-port"
            ) from exc
        port = int(sock.getsockname()[1])
        server = HttpServer(build_app(state), sock, graceful_s=config.shutdown_grace_s)
        await server.start()
        if config.num_frontends > 1:
            fleet = FrontendFleet(config.num_frontends - 1, port)
            await fleet.start()
            state.frontend_pids = [os.getpid(), *fleet.pids]
            fleet.on_change = lambda pids: state.frontend_pids.__setitem__(slice(None), [os.getpid(), *pids])
        elif args.frontend_group_pid:
            state.frontend_pids = [args.frontend_group_pid, os.getpid()]
        base_url = f"http://{config.http_host}:{port}"
        advertised = await runtime.namespace().component("frontend").endpoint("http").advertise(
            transport="http", address=f"{config.http_host}:{port}", role="frontend",
            labels={"metrics_url": f"{base_url}/metrics", "router_mode": config.router_mode},
        )
        logger.info(
            "frontend listening url=http://%s:%d router_mode=%s models=%d frontends=%d",
            config.http_host, port, config.router_mode, len(registry.models), config.num_frontends,
        )
        await stop.wait()
        # Graceful: refuse new work, let admitted streams finish, then close.
        state.draining = True
        await advertised.deregister()
        logger.info("frontend draining inflight=%d grace_s=%.1f", state.inflight, config.shutdown_grace_s)
        if fleet is not None:
            await fleet.stop(config.shutdown_grace_s)
        if not await state.wait_idle(config.shutdown_grace_s):
            logger.warning("frontend stopping with requests in flight count=%d", state.inflight)
        return 0
    finally:
        if server is not None:
            await server.stop()
        if fleet is not None:
            await fleet.stop(0)
        if registry is not None:
            await registry.close()
        if routers is not None:
            await routers.close()
        if sync is not None:
            await sync.close()
        await runtime.shutdown(grace_s=1.0)
        logger.info("frontend stopped")
