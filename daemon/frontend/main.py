"""OpenAI-compatible HTTP frontend: discovers models, preprocesses, routes, migrates, streams.

``dynamod --role frontend [--http-port 8000] [--router-mode round-robin|random|kv]``. Models appear
as workers publish their cards (no model flag here). ``--num-frontends N`` runs N processes on one
port (``SO_REUSEPORT``) that share routing state over the event plane.

The OpenAI port's doors (``http/request_checks.py``): API keys (``--api-key-file`` / ``DYN_API_KEY``; the file is
re-read when it changes and on SIGHUP), a per-client rate limit, a body cap, and HTTPS with
``--http-tls-cert-file``/``--http-tls-key-file``. Listening beyond loopback without keys is
allowed, with a warning at start.

Shutdown (SIGTERM/SIGINT): ``/health`` turns 503 and new requests get 503 at once, streams already
admitted run to their end (up to ``--shutdown-grace``), then the server and runtime close.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import ssl
from dataclasses import replace

from dynamod.daemon.frontend.app import build_app, traces_reply
from dynamod.daemon.frontend.http import connections as conn
from dynamod.daemon.frontend.http.auth import ApiKeys
from dynamod.daemon.frontend.http.fleet_metrics import FleetMetrics, fleet_labels
from dynamod.daemon.frontend.http.limits import (
    DEFAULT_AUTH_FAILURE_BURST,
    DEFAULT_AUTH_FAILURE_RATE,
    DEFAULT_MAX_BODY_BYTES,
)
from dynamod.daemon.frontend.http.port_sharing import FrontendFleet
from dynamod.daemon.frontend.http.request_checks import TRACES_PATH, DoorSettings, RefusalMetrics
from dynamod.daemon.frontend.http.server import HttpServer, bind_socket
from dynamod.daemon.frontend.openai.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST
from dynamod.daemon.frontend.pipeline.dispatch import Dispatcher
from dynamod.daemon.frontend.pipeline.metrics import FrontendMetrics
from dynamod.daemon.frontend.pipeline.models import ModelRegistry
from dynamod.daemon.frontend.pipeline.router_factory import RouterFactoryBuilder, add_kv_router_args
from dynamod.daemon.frontend.pipeline.routing import ROUTER_MODES, Quarantine
from dynamod.daemon.frontend.pipeline.state import FrontendConfig, FrontendState
from dynamod.daemon.frontend.pipeline.worker_health import RoutingSync
from dynamod.daemon.frontend.preprocess.media import add_media_args, media_settings_from_args
from dynamod.daemon.router.core.disagg_policy import add_disagg_args, disagg_config_from_args
from dynamod.daemon.router.core.prefill_stage import DEFAULT_PREFILL_TIMEOUT_S, DisaggMetrics, PrefillStage
from dynamod.shared.config import add_runtime_args, env_or, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.security.tls import TlsFiles, server_context
from dynamod.shared.transport.address import is_loopback_host, join_host_port

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
                   help="generations admitted at once (a request with P prompts and n choices counts P x n); more get "
                        "503 with Retry-After [default 4096]")
    g.add_argument("--max-prompts-per-request", type=int,
                   default=int(env_or("DYN_MAX_PROMPTS_PER_REQUEST", str(DEFAULT_MAX_PROMPTS_PER_REQUEST))),
                   help="batched prompts x n one request may ask for; more get 400 before any prompt is tokenized "
                        f"[env DYN_MAX_PROMPTS_PER_REQUEST, default {DEFAULT_MAX_PROMPTS_PER_REQUEST}]")
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
    g.add_argument("--responses-store-size", type=int, default=env_or("DYN_RESPONSES_STORE_SIZE", "1024"),
                   help="finished /v1/responses kept in this process's memory for previous_response_id and "
                        "GET /v1/responses/{id}, least recently used out; 0 keeps none "
                        "[env DYN_RESPONSES_STORE_SIZE, default 1024]")
    add_door_args(g)
    add_media_args(g)
    add_prefill_timeout_arg(g)
    add_runtime_args(parser)
    add_kv_router_args(parser)
    add_disagg_args(parser)


def add_door_args(g: argparse._ArgumentGroup) -> None:
    """The OpenAI port's keys, limits and HTTPS (``http/request_checks.py``). Key values only from a file or the
    environment: a flag's value is visible to every user in ``ps``."""
    g.add_argument("--api-key-file", default=env_or("DYN_API_KEY_FILE", "") or None,
                   help="file of API keys the OpenAI port accepts as 'Authorization: Bearer KEY', one per line (re-read "
                        "when it changes and on SIGHUP); keys may also be given, comma-separated, in DYN_API_KEY; "
                        "/live stays open, /health shows only its status without a key and /metrics also "
                        "takes the cluster token "
                        "[env DYN_API_KEY_FILE, default: no keys, the port is open]")
    g.add_argument("--rate-limit", type=float, default=float(env_or("DYN_HTTP_RATE_LIMIT", "0")),
                   help="requests per second each client (API key, else address) may send (all routes but /live, /health and /metrics); more get "
                        "429 with Retry-After; 0 = no limit [env DYN_HTTP_RATE_LIMIT, default 0]")
    g.add_argument("--rate-limit-burst", type=float, default=float(env_or("DYN_HTTP_RATE_LIMIT_BURST", "0")),
                   help="requests a client may send at once above its rate; 0 = the rate (at least 1) "
                        "[env DYN_HTTP_RATE_LIMIT_BURST, default 0]")
    g.add_argument("--max-body-bytes", type=int,
                   default=int(env_or("DYN_HTTP_MAX_BODY_BYTES", str(DEFAULT_MAX_BODY_BYTES))),
                   help="largest request body accepted; a larger one gets 413 before it is read "
                        f"[env DYN_HTTP_MAX_BODY_BYTES, default {DEFAULT_MAX_BODY_BYTES}]")
    g.add_argument("--auth-failure-rate", type=float,
                   default=float(env_or("DYN_HTTP_AUTH_FAILURE_RATE", str(DEFAULT_AUTH_FAILURE_RATE))),
                   help="with API keys: failed key checks per second one client address may make on any route "
                        "(/health and /metrics included); past it and the burst, 429 before the key is checked; "
                        f"0 = no limit [env DYN_HTTP_AUTH_FAILURE_RATE, default {DEFAULT_AUTH_FAILURE_RATE:g}]")
    g.add_argument("--auth-failure-burst", type=float,
                   default=float(env_or("DYN_HTTP_AUTH_FAILURE_BURST", str(DEFAULT_AUTH_FAILURE_BURST))),
                   help="failed key checks an address may make at once "
                        f"[env DYN_HTTP_AUTH_FAILURE_BURST, default {DEFAULT_AUTH_FAILURE_BURST:g}]")
    add_http_connection_args(g)
    g.add_argument("--http-tls-cert-file", default=env_or("DYN_HTTP_TLS_CERT_FILE", "") or None,
                   help="certificate (PEM) to serve the OpenAI port over HTTPS [env DYN_HTTP_TLS_CERT_FILE, default: "
                        "plain HTTP]")
    g.add_argument("--http-tls-key-file", default=env_or("DYN_HTTP_TLS_KEY_FILE", "") or None,
                   help="its private key (PEM; may be inside the certificate file) [env DYN_HTTP_TLS_KEY_FILE]")


def add_http_connection_args(g: argparse._ArgumentGroup) -> None:
    """Caps and deadlines of every HTTP connection, applied before its request is read (``connections``)."""
    g.add_argument("--http-max-connections", type=int,
                   default=int(env_or("DYN_HTTP_MAX_CONNECTIONS", str(conn.DEFAULT_MAX_CONNECTIONS))),
                   help="HTTP connections held at once; more get 503 and are closed "
                        f"[env DYN_HTTP_MAX_CONNECTIONS, default {conn.DEFAULT_MAX_CONNECTIONS}]")
    g.add_argument("--http-max-connections-per-address", type=int,
                   default=int(env_or("DYN_HTTP_MAX_CONNECTIONS_PER_ADDRESS", str(conn.DEFAULT_MAX_CONNECTIONS_PER_ADDRESS))),
                   help="the same from one client address "
                        f"[env DYN_HTTP_MAX_CONNECTIONS_PER_ADDRESS, default {conn.DEFAULT_MAX_CONNECTIONS_PER_ADDRESS}]")
    g.add_argument("--http-idle-timeout", type=float,
                   default=float(env_or("DYN_HTTP_IDLE_TIMEOUT", str(conn.DEFAULT_IDLE_TIMEOUT_S))),
                   help="seconds a new connection may send nothing before it is closed; 0 = never "
                        f"[env DYN_HTTP_IDLE_TIMEOUT, default {conn.DEFAULT_IDLE_TIMEOUT_S:g}]")
    g.add_argument("--http-header-timeout", type=float,
                   default=float(env_or("DYN_HTTP_HEADER_TIMEOUT", str(conn.DEFAULT_HEADER_TIMEOUT_S))),
                   help="seconds from a request's first byte to the end of its headers, then 408; 0 = no limit "
                        f"[env DYN_HTTP_HEADER_TIMEOUT, default {conn.DEFAULT_HEADER_TIMEOUT_S:g}]")
    g.add_argument("--http-body-timeout", type=float,
                   default=float(env_or("DYN_HTTP_BODY_TIMEOUT", str(conn.DEFAULT_BODY_TIMEOUT_S))),
                   help="seconds from the end of the headers to the end of the body, then 408; 0 = no limit "
                        f"[env DYN_HTTP_BODY_TIMEOUT, default {conn.DEFAULT_BODY_TIMEOUT_S:g}]")


def http_connection_limits_from_args(args: argparse.Namespace) -> conn.HttpConnectionLimits:
    return conn.HttpConnectionLimits(
        max_connections=args.http_max_connections,
        max_connections_per_address=args.http_max_connections_per_address,
        idle_timeout_s=args.http_idle_timeout,
        header_timeout_s=args.http_header_timeout,
        body_timeout_s=args.http_body_timeout,
    ).validate()


def door_settings_from_args(args: argparse.Namespace) -> DoorSettings:
    if args.max_body_bytes < 1:
        raise ConfigError("--max-body-bytes must be at least 1")
    if args.auth_failure_rate < 0 or args.auth_failure_burst < 0:
        raise ConfigError("--auth-failure-rate and --auth-failure-burst must be 0 (off / default) or more")
    if args.rate_limit < 0 or args.rate_limit_burst < 0:
        raise ConfigError("--rate-limit and --rate-limit-burst must be 0 (off / default) or more")
    return DoorSettings(
        api_keys=ApiKeys.from_sources(args.api_key_file, os.environ.get("DYN_API_KEY")),
        rate_limit=args.rate_limit,
        rate_limit_burst=args.rate_limit_burst,
        max_body_bytes=args.max_body_bytes,
        auth_failure_rate=args.auth_failure_rate,
        auth_failure_burst=args.auth_failure_burst,
    )


def https_context_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.http_tls_cert_file and not args.http_tls_key_file:
        return None
    files = TlsFiles(cert_file=args.http_tls_cert_file, key_file=args.http_tls_key_file)
    if not files.cert_file:
        raise ConfigError("HTTPS: --http-tls-key-file needs its certificate in --http-tls-cert-file")
    return server_context(files, require_client_cert=False, what="HTTPS frontend")


is_loopback = is_loopback_host  # one rule for every role (shared/transport/address.py)


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


def forget_departed_worker(registry: ModelRegistry, metrics: FrontendMetrics):  # noqa: ANN201 - a listener
    """A model-worker listener that drops a worker's per-worker series once it serves no model."""

    def listener(_model: object, worker_id: int, added: bool) -> None:
        if not added and not any(worker_id in m.workers for m in registry.models.values()):
            metrics.forget_worker(worker_id)

    return listener


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    if args.num_frontends < 1:
        raise ConfigError("--num-frontends must be at least 1")
    if args.migration_limit is not None and args.migration_limit < 0:
        raise ConfigError("--migration-limit must be 0 or more")
    if args.max_inflight < 1:
        raise ConfigError("--max-inflight must be at least 1")
    if not 1 <= args.max_prompts_per_request <= args.max_inflight:
        raise ConfigError(
            f"--max-prompts-per-request must be 1..--max-inflight ({args.max_inflight}), got {args.max_prompts_per_request}"
        )
    if args.worker_wait < 0:
        raise ConfigError("--worker-wait must be 0 or more")
    if args.responses_store_size < 0:
        raise ConfigError("--responses-store-size must be 0 or more")
    return FrontendConfig(
        http_host=args.http_host,
        http_port=args.http_port,
        router_mode=args.router_mode,
        migration_limit=args.migration_limit if args.migration_limit is not None else -1,
        worker_wait_s=args.worker_wait,
        max_inflight=args.max_inflight,
        max_prompts_per_request=args.max_prompts_per_request,
        coalesce_s=max(0.0, args.token_coalesce_ms) / 1000.0,
        shutdown_grace_s=args.shutdown_grace,
        num_frontends=args.num_frontends,
        responses_store_size=args.responses_store_size,
        media=media_settings_from_args(args),
    )


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    config = config_from_args(args)
    settings = settings_from_args(args)
    # A fleet: copies started by this process (--num-frontends), one of those copies, or one of the
    # frontends `dynamod up --num-frontends N` starts on a shared port (--reuse-port).
    in_fleet = args.num_frontends > 1 or args.frontend_group_pid is not None or args.reuse_port
    if in_fleet and settings.system_port is None:
        settings.system_port = 0  # each member's own /metrics, which the shared port's /metrics adds up
    runtime = await DistributedRuntime.create(settings)
    sync: RoutingSync | None = None
    registry: ModelRegistry | None = None
    server: HttpServer | None = None
    fleet: FrontendFleet | None = None
    routers: RouterFactoryBuilder | None = None
    state: FrontendState | None = None
    try:
        metrics = FrontendMetrics(runtime.registry)
        quarantine = Quarantine(hold_s=settings.lease_ttl_s + 1.0)
        sync = RoutingSync(runtime, quarantine)
        routers = RouterFactoryBuilder(config.router_mode, args, runtime, sync)
        registry = ModelRegistry(runtime, metrics, quarantine, routers.build, routers.build_prefill)
        routers.attach(registry)
        registry.worker_listeners.append(forget_departed_worker(registry, metrics))
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
        # The cluster token opens /metrics behind API keys too: the cluster's scrapers carry no key.
        doors = replace(door_settings_from_args(args), member_token=settings.security.request_plane.token)
        https = https_context_from_args(args)
        if doors.api_keys is None and not is_loopback(config.http_host):
            logger.warning(
                "frontend listening beyond loopback without API keys host=%s hint=set --api-key-file or DYN_API_KEY",
                config.http_host,
            )
        refused = RefusalMetrics.counter(runtime.registry)
        server = HttpServer(
            build_app(state, doors), sock, graceful_s=config.shutdown_grace_s, ssl_context=https,
            connection_limits=http_connection_limits_from_args(args), on_refused=lambda r: refused.labels(r).inc(),
        )
        await server.start()
        keys = doors.api_keys
        if keys is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
        if config.num_frontends > 1:
            fleet = FrontendFleet(config.num_frontends - 1, port)
            await fleet.start()
            state.frontend_pids = [os.getpid(), *fleet.pids]
            fleet.on_change = lambda pids: state.frontend_pids.__setitem__(slice(None), [os.getpid(), *pids])
        elif args.frontend_group_pid:
            state.frontend_pids = [args.frontend_group_pid, os.getpid()]
        # Discovery gets an address other hosts can dial: never 0.0.0.0 (shared/transport/address.py).
        http_address = join_host_port(runtime.settings.advertised(config.http_host), port)
        scheme = "https" if https is not None else "http"
        base_url = f"{scheme}://{http_address}"
        advertised = await runtime.namespace().component("frontend").endpoint("http").advertise(
            transport="http", address=http_address, role="frontend",
            labels={
                "metrics_url": f"{base_url}/metrics", "router_mode": config.router_mode,
                **(fleet_labels(base_url, runtime.status_url) if in_fleet and runtime.status_url else {}),
            },
        )
        if in_fleet and runtime.status_url:
            # A member advertises its status server (metrics_url), not the shared port that lands on
            # any member: its spans are read there too (``dynamoctl trace``, the console).
            runtime.add_status_route(TRACES_PATH, traces_reply)
            peers = await runtime.namespace().component("frontend").endpoint("http").client()
            state.fleet_metrics = FleetMetrics(
                runtime.registry, peers, fleet=base_url, own_instance_id=runtime.instance_id,
                token=settings.security.request_plane.token,  # the members' own /metrics want it
            )
        logger.info(
            "frontend listening url=%s://%s:%d router_mode=%s models=%d frontends=%d api_keys=%d rate_limit=%g "
            "max_body_bytes=%d",
            scheme, config.http_host, port, config.router_mode, len(registry.models), config.num_frontends,
            len(keys) if keys is not None else 0, doors.rate_limit, doors.max_body_bytes,
        )
        # Everything built so far (modules, the app, the routers, the loaded models) lives as long as
        # the process: out of the collector's way, a full collection no longer walks it on every
        # request's garbage (about 17 % of the frontend's CPU went to collections, mostly full ones).
        gc.freeze()
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
        if state is not None and state.fleet_metrics is not None:
            await state.fleet_metrics.close()
        if state is not None and state.media is not None:
            await state.media.aclose()
        if routers is not None:
            await routers.close()
        if sync is not None:
            await sync.close()
        await runtime.shutdown(grace_s=1.0)
        logger.info("frontend stopped")
