"""Start a local cluster: a frontend and N workers (or a prefill and a decode pool), no external servers.

    dynamod up [--workers 2] [--http-port 8000] [--engine mocker] [--model tiny] [--speedup-ratio R]
    dynamod up --prefill-workers P --decode-workers D [...]     disaggregated: two pools
    dynamod up --model tiny-vl --encode-workers E [...]         images encoded by an encode pool
    dynamod up --planner load|sla --min-workers N --max-workers M  a planner sizes the pools

With ``--planner`` (or ``--accept-scaling`` for a planner started elsewhere) the supervisor also
runs the scaler (``scaler.py``): it adds and removes worker children on the planner's request,
and the planner itself is one more child (``--role planner --connector local``), stopped first.

Aggregated (default): ``--workers`` agg workers each prefill and decode their own requests.
Disaggregated: ``--prefill-workers`` and ``--decode-workers`` start the two pools *instead of* agg
workers. Agg and decode workers would register in the same component and serve the same model, so
the frontend would send decode-stage requests (carrying transfer parameters) to agg workers too: a
mix that makes no sense, so giving ``--workers`` with either pool flag is an error. Decode workers
without a prefill pool (``--prefill-workers 0``) prefill locally; a prefill pool without decode
workers could serve nothing and is refused.

Discovery is the file backend in the default directory (so ``dynamoctl`` and ``dynamo-console``
find the cluster without flags), events go over ZMQ, and every part is a real ``dynamod`` process
that is restarted if it crashes or hangs (probed as it serves: ``probe.py``); a crashed child's last
log lines are printed here. A child that exits with a usage error (status 2, a bad flag) stops `up` at
once with its error line: no restart fixes it. A worker that dies ``--crash-limit`` times within
``--crash-window`` seconds is not restarted again, but while its pool has other workers the cluster
serves on without it (``failed.py``: it is listed in discovery, ``dynamoctl restart NAME`` tries it
again); any other child in a crash loop, or a pool's last worker, stops the cluster and `up` exits
non-zero naming the child and its log. Flags `up` sets are refused in the pass-through flags
(``passthrough.py``), and one `up` runs per discovery directory (``cluster_lock.py``). Every
child runs ``python -P`` (see ``launcher.py``), so a folder named ``dynamod`` in the directory `up`
is started from cannot shadow the package. A child's log rotates when it would pass
``--log-max-bytes`` (``worker-0.log`` -> ``worker-0.log.1`` ... ``.<--log-backups>``): the
supervisor reads the child's output from a pipe and writes the file itself (``logfile.py`` says why
not copy-truncate), so rotation loses no line. Ctrl-C or SIGTERM stops the frontend first (it finishes
the streams it admitted), then the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamod.daemon.supervisor.children import ChildSpec, CrashLoopError, CrashLoopPolicy, Supervisor
from dynamod.daemon.supervisor.cluster_lock import ClusterLock
from dynamod.daemon.supervisor.failed import FailedWorkers
from dynamod.daemon.supervisor.launcher import daemon_child, daemon_env
from dynamod.daemon.supervisor.logfile import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, parse_size
from dynamod.daemon.supervisor.passthrough import check_owned, flag_value, join_passthrough_values
from dynamod.daemon.supervisor.planner_profile import write_profile
from dynamod.daemon.supervisor.probe import HttpTarget, frontend_target, probe_host
from dynamod.daemon.supervisor.prometheus_sd import PrometheusSdWriter
from dynamod.daemon.supervisor.scaler import DEFAULT_DRAIN_TIMEOUT_S, PoolBudget, PoolTemplate, Scaler
from dynamod.shared.config import DEFAULT_NAMESPACE, RuntimeSettings
from dynamod.shared.discovery.factory import default_file_kv_dir
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.encode import ENCODER_COMPONENT, ROLE_ENCODE
from dynamod.shared.protocol.planner import POOL_AGG, POOL_COMPONENT, POOL_DECODE, POOL_PREFILL
from dynamod.shared.protocol.routing import ROUTER_MODES
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.security.settings import add_security_args, security_env, security_from_args
from dynamod.shared.transport.ports import free_port

logger = logging.getLogger(__name__)

FRONTEND = "frontend"
PLANNER = "planner"
ROLE_AGG, ROLE_PREFILL, ROLE_DECODE = "agg", "prefill", "decode"
# The worker daemon's components per pool (shared/protocol/planner.py, as Dynamo names them).
PREFILL_COMPONENT, DECODE_COMPONENT = POOL_COMPONENT[POOL_PREFILL], POOL_COMPONENT[POOL_DECODE]
# Mocker flags `up` passes through to every worker when given.
_WORKER_PASSTHROUGH = ("speedup_ratio", "block_size", "num_gpu_blocks", "max_num_seqs")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster")
    g.add_argument("--workers", type=int, default=None,
                   help="agg workers (prefill and decode their own requests) [default 2; not with the pool flags]")
    g.add_argument("--prefill-workers", type=int, default=None,
                   help="prefill workers (--role prefill): a disaggregated cluster; needs --decode-workers")
    g.add_argument("--decode-workers", type=int, default=None,
                   help="decode workers (--role decode); without prefill workers they prefill locally")
    g.add_argument("--encode-workers", type=int, default=0,
                   help="encode workers (--role encode) running the vision encoder of a vision-language --model "
                        "(tiny-vl): the frontend sends them the images, the workers read the embeddings [default 0: "
                        "the workers encode images themselves]")
    g.add_argument("--encode-args", default="", metavar="FLAGS",
                   help="extra flags for encode workers, e.g. '--encode-ms-per-image-token 0.1'")
    g.add_argument("--engine", default="mocker", help="engine of the workers [default mocker]")
    g.add_argument("--model", default="tiny", help="model directory, or 'tiny' [default tiny]")
    g.add_argument("--http-host", default="127.0.0.1", help="frontend address [default 127.0.0.1]")
    g.add_argument("--http-port", type=int, default=8000, help="frontend port [default 8000]")
    g.add_argument("--router-mode", choices=ROUTER_MODES, default=None,
                   help="how the frontend picks a worker [default kv with --planner/--accept-scaling, "
                        "else round-robin]")
    g.add_argument("--num-frontends", type=int, default=1, help="frontend processes on the port [default 1]")
    g.add_argument("--namespace", default=None, help=f"namespace [env DYN_NAMESPACE, default {DEFAULT_NAMESPACE}]")
    g.add_argument("--file-kv", default=None, help="file discovery directory [env DYN_FILE_KV, default per user]")
    g.add_argument("--log-dir", default=None, help="children's log files [default: beside the discovery directory]")
    g.add_argument("--log-to-console", action="store_true", help="children log to this terminal instead of files")
    g.add_argument("--log-max-bytes", type=_size, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                   help="a child's log rotates before it passes this size (bytes, or with K, M, G); 0 never rotates "
                        f"[default {DEFAULT_MAX_BYTES // 2**20}M]")
    g.add_argument("--log-backups", type=int, default=DEFAULT_BACKUPS,
                   help="rotated logs kept per child (name.log.1 is the newest); 0 keeps none, the log starts "
                        f"over [default {DEFAULT_BACKUPS}]")
    # The word after each *-args flag is its value even when it starts with "-" (parse_args).
    g.add_argument("--worker-args", default="", metavar="FLAGS",
                   help='extra flags for every worker, quoted as one argument, e.g. "--max-num-seqs 64"; the '
                        "argument after each *-args flag is its value even when it starts with -- "
                        "(--worker-args --enforce-eager); not the flags `up` sets: --engine, --model, --worker-name, "
                        "--system-port, --namespace, --file-kv")
    g.add_argument("--prefill-args", default="", metavar="FLAGS",
                   help="extra flags for prefill workers only (after --worker-args)")
    g.add_argument("--decode-args", default="", metavar="FLAGS",
                   help="extra flags for decode workers only (after --worker-args)")
    g.add_argument("--frontend-args", default="", metavar="FLAGS",
                   help='extra flags for the frontend, e.g. "--router-conditional-disagg" or "--http-tls-cert-file C '
                        '--http-tls-key-file K" (the supervisor then probes it over HTTPS); not --http-host, '
                        "--http-port, --router-mode, --num-frontends: use up's own")
    g.add_argument("--prometheus-sd", type=Path, default=None, metavar="PATH",
                   help="keep a Prometheus file_sd JSON file of this cluster's /metrics at PATH (what `dynamoctl "
                        "targets --prometheus` prints; a crashed worker stays listed so its `up` is 0) [default off]")
    g.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for the cluster [default 120]")
    g.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds children get to stop [default 30]")
    g.add_argument("--crash-limit", type=int, default=CrashLoopPolicy.max_crashes,
                   help="a child that dies this many times within --crash-window is not restarted: a worker whose "
                        "pool has others is left failed (`dynamoctl restart NAME` retries it), any other child stops "
                        "`up` with a non-zero exit; 0 restarts for ever. A child that exits with a usage error "
                        f"(status 2: a bad flag) stops `up` at once [default {CrashLoopPolicy.max_crashes}]")
    g.add_argument("--hang-timeout", type=float, default=ChildSpec.hang_after_s, metavar="S",
                   help="seconds a child may leave its liveness probe (/live) unanswered before it is killed and "
                        f"restarted [default {ChildSpec.hang_after_s:g}]")
    g.add_argument("--crash-window", type=float, default=CrashLoopPolicy.window_s,
                   help=f"seconds over which --crash-limit counts a child's deaths [default {CrashLoopPolicy.window_s:g}]")
    m = parser.add_argument_group("mocker flags passed to every worker")
    m.add_argument("--speedup-ratio", type=float, default=None, help="mocker step times are divided by this")
    m.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    m.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per worker")
    m.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once per worker")
    s = parser.add_argument_group("scaling (a planner adds and removes workers)")
    s.add_argument("--planner", choices=("load", "sla"), default=None,
                   help="run a planner (`dynamod --role planner --connector local`) that sizes the worker pools "
                        "within --min-workers..--max-workers; without --workers an agg cluster starts at "
                        "--min-workers [default: no planner]")
    s.add_argument("--min-workers", type=int, default=1, help="fewest workers per pool the planner keeps [default 1]")
    s.add_argument("--max-workers", type=int, default=4,
                   help="most workers per pool the planner may start; the supervisor clamps to it too [default 4]")
    s.add_argument("--planner-args", default="", metavar="FLAGS",
                   help='extra flags for the planner, e.g. "--adjustment-interval 5 --ttft 200" [default none]')
    s.add_argument("--accept-scaling", action="store_true",
                   help="let a planner started elsewhere on this host (`--connector local`, same discovery "
                        "directory and namespace) add and remove workers; implied by --planner [default off]")
    s.add_argument("--scale-drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="seconds a worker being removed gets to finish its in-flight requests before it is "
                        f"stopped [default {DEFAULT_DRAIN_TIMEOUT_S:g}]")
    # The same security flags as every role; children inherit them as DYN_* variables.
    add_security_args(parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse, after gluing each pass-through flag to its value (``passthrough.py``), so
    ``--frontend-args "--router-conditional-disagg"`` is a value and not a flag."""
    return parser.parse_args(join_passthrough_values(argv))


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class Pools:
    """How many workers of each role `up` starts (agg, or prefill + decode, never both)."""

    agg: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    def by_role(self) -> list[tuple[str, int]]:
        """(role, count) in start order: prefill before decode, so a decode worker finds its pool."""
        return [(ROLE_AGG, self.agg), (ROLE_PREFILL, self.prefill), (ROLE_DECODE, self.decode)]

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.prefill} prefill + {self.decode} decode worker(s)"
        return f"{self.agg} worker(s)"


def resolve_pools(args: argparse.Namespace) -> Pools:
    """The worker counts from the flags; ``ConfigError`` for a combination that makes no sense."""
    prefill, decode, agg = args.prefill_workers, args.decode_workers, args.workers
    for flag, value in (("--workers", agg), ("--prefill-workers", prefill), ("--decode-workers", decode)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be 0 or more")
    if prefill is None and decode is None:
        return Pools(agg=2 if agg is None else agg)
    if agg is not None:
        raise ConfigError(
            "--workers (agg) cannot be combined with --prefill-workers/--decode-workers: agg and decode workers "
            "would serve the same model from one component; use the pool flags alone"
        )
    if not decode:
        raise ConfigError("a disaggregated cluster needs --decode-workers 1 or more (prefill workers only compute KV)")
    return Pools(prefill=prefill or 0, decode=decode)


def crash_policy(args: argparse.Namespace) -> CrashLoopPolicy:
    if args.crash_limit < 0:
        raise ConfigError("--crash-limit must be 0 (never give up) or more")
    if args.hang_timeout <= 0:
        raise ConfigError("--hang-timeout must be more than 0 seconds")
    if args.crash_window <= 0:
        raise ConfigError("--crash-window must be more than 0 seconds")
    return CrashLoopPolicy(max_crashes=args.crash_limit, window_s=args.crash_window)


class WorkerFactory:
    """Builds the ``ChildSpec`` of any worker of this cluster: the first ones, and the ones the
    scaler adds later (same flags, a status port not handed out before)."""

    def __init__(self, args: argparse.Namespace, runtime: list[str], env: dict[str, str]) -> None:
        self._args = args
        self._runtime = runtime
        self._env = env
        self._passthrough: list[str] = []
        for name in _WORKER_PASSTHROUGH:
            value = getattr(args, name)
            if value is not None:
                self._passthrough += [f"--{name.replace('_', '-')}", str(value)]
        self._extra = shlex.split(args.worker_args)
        self._role_extra = {
            ROLE_AGG: [], ROLE_PREFILL: shlex.split(args.prefill_args), ROLE_DECODE: shlex.split(args.decode_args),
        }

    def engine_flags(self, role: str) -> list[str]:
        """The flags a ``role`` worker gets beyond its runtime and identity: what shapes its engine."""
        return [*self._passthrough, *self._extra, *self._role_extra[role]]

    def encode_spec(self, index: int) -> ChildSpec:
        """An encode worker: the model and the mocker's speedup, not the engine flags (it has no
        engine of the workers' kind); ``--encode-args`` after them."""
        args = self._args
        status_port = free_port()
        speedup = [] if args.speedup_ratio is None else ["--speedup-ratio", str(args.speedup_ratio)]
        argv = [
            "--role", ROLE_ENCODE, *self._runtime, "--model", args.model, "--system-port", str(status_port),
            *speedup, *shlex.split(getattr(args, "encode_args", "") or ""),
        ]
        live = HttpTarget(f"http://127.0.0.1:{status_port}").url("/live")
        spec = daemon_child(child_name(ROLE_ENCODE, index), argv, live_url=live, env=self._env)
        spec.hang_after_s = args.hang_timeout
        spec.pool = ROLE_ENCODE
        return spec

    def spec(self, role: str, index: int) -> ChildSpec:
        args = self._args
        status_port = free_port()
        # The child's name is its worker name: the operator's intent (drain, sleep, LoRAs)
        # follows it across restarts, by the supervisor or of `up` itself.
        worker = [
            "--role", role, *self._runtime, "--engine", args.engine, "--model", args.model,
            "--worker-name", child_name(role, index),
            "--system-port", str(status_port), *self.engine_flags(role),
        ]
        # Probed where it binds: --system-host in the worker's flags or environment, a wildcard on loopback.
        host = flag_value(self.engine_flags(role), "--system-host") or self._env.get("DYN_SYSTEM_HOST") or "127.0.0.1"
        live = HttpTarget(f"http://{probe_host(host)}:{status_port}").url("/live")
        spec = daemon_child(child_name(role, index), worker, live_url=live, env=self._env)
        spec.hang_after_s = args.hang_timeout
        spec.pool = role  # a crash loop gives up on it alone while its pool has other workers
        return spec


def runtime_flags(file_kv: str, namespace: str) -> tuple[list[str], dict[str, str]]:
    """Every child's runtime flags and environment: file discovery in ``file_kv``, ZMQ events."""
    runtime = ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", file_kv, "--namespace", namespace]
    # A pinned request-plane port is one process's: every child asking for it would collide.
    env = daemon_env({"DYN_FILE_KV": file_kv}, drop=("DYN_DISCOVERY_BACKEND", "DYN_EVENT_PLANE", "DYN_REQUEST_PLANE_PORT"))
    return runtime, env


def router_mode(args: argparse.Namespace) -> str:
    """``--router-mode``, else ``kv`` when workers come and go (a planner), else ``round-robin``.

    Round-robin hands a worker that just joined 1/N of the *new* requests and nothing of the
    backlog queued on the old ones, so under the queued load that made the planner scale up the
    old worker stays saturated while the new one idles (issue 22: RUN 4 / WAIT 5 / 94% KV beside
    idle workers). The KV router costs each worker by its active prefill tokens and decode blocks:
    an empty new worker is the cheapest candidate, so it takes new requests from its first
    interval until the pool is even. Without a planner the fleet is fixed and round-robin's
    equal shares are as good, at no bookkeeping cost.
    """
    if args.router_mode:
        return str(args.router_mode)
    return "kv" if getattr(args, "planner", None) or getattr(args, "accept_scaling", False) else "round-robin"


def frontend_names(count: int) -> list[str]:
    """``frontend``, then ``frontend-1``, ``frontend-2``, ... for ``--num-frontends``."""
    return [FRONTEND, *(f"{FRONTEND}-{i}" for i in range(1, count))]


def build_specs(
    args: argparse.Namespace, file_kv: str, namespace: str, workers: WorkerFactory | None = None
) -> list[ChildSpec]:
    runtime, env = runtime_flags(file_kv, namespace)
    # --num-frontends N: N supervised children on one port (SO_REUSEPORT), not one frontend with
    # N-1 copies of its own: killing any one leaves the others serving while it is restarted.
    frontend = [
        "--role", "frontend", *runtime,
        "--http-host", args.http_host, "--http-port", str(args.http_port),
        "--router-mode", router_mode(args), "--num-frontends", "1",
        *(["--reuse-port"] if args.num_frontends > 1 else []),
        *shlex.split(args.frontend_args),
    ]
    # Probed as it serves: HTTPS with --http-tls-cert-file (probe.py).
    target = frontend_target(args.http_host, args.http_port, shlex.split(args.frontend_args), env)
    specs = [
        daemon_child(name, frontend, live_url=target.url("/live"), live_ssl=target.ssl_context, env=env)
        for name in frontend_names(args.num_frontends)
    ]
    for spec in specs:
        spec.hang_after_s = args.hang_timeout
    workers = workers or WorkerFactory(args, runtime, env)
    pools = resolve_pools(args)
    for role, count in pools.by_role():
        for index in range(count):
            specs.append(workers.spec(role, index))
    encode_workers = getattr(args, "encode_workers", 0) or 0
    if encode_workers < 0:
        raise ConfigError("--encode-workers must be 0 or more")
    for index in range(encode_workers):
        specs.append(workers.encode_spec(index))
    if getattr(args, "planner", None):
        specs.append(planner_spec(args, runtime, env, pools, planner_profile_flags(args, pools, workers, file_kv)))
    return specs


def planner_spec(
    args: argparse.Namespace, runtime: list[str], env: dict[str, str], pools: Pools, extra: Sequence[str] = ()
) -> ChildSpec:
    """``dynamod --role planner --connector local`` sizing this cluster's pools within the budget."""
    planner = [
        "--role", "planner", *runtime, "--connector", "local",
        "--planner", args.planner, "--mode", "disagg" if pools.disaggregated else "agg",
        "--min-workers", str(args.min_workers), "--max-workers", str(args.max_workers),
        *mocker_startup_flags(args), *extra, *shlex.split(args.planner_args),
    ]
    if getattr(args, "prometheus_sd", None) is not None:
        # Its /metrics (desired vs current replicas) for the file_sd file: a status server on a free port.
        planner += ["--system-port", str(free_port())]
    return daemon_child(PLANNER, planner, env=env)


MOCKER_STARTUP_S = 5.0  # a mocker worker's launch to ready here: a process start, no weights to load


def mocker_startup_flags(args: argparse.Namespace) -> list[str]:
    """``--worker-startup-time`` for a planner over mocker workers, unless the operator set one.

    The planner waits for a smaller fleet to have sufficed over a multiple of a worker's start-up
    before it shrinks a pool (a worker given up costs a start-up to get back). Its default, 30 s,
    is a GPU engine's; mocker workers start in seconds, and on their default an idle `dynamod up`
    took three minutes to return to its minimum."""
    named = "--worker-startup-time" in shlex.split(args.planner_args) or os.environ.get("DYN_PLANNER_WORKER_STARTUP_TIME")
    if args.engine != "mocker" or named:
        return []
    return ["--worker-startup-time", f"{MOCKER_STARTUP_S:g}"]


def planner_profile_flags(args: argparse.Namespace, pools: Pools, workers: WorkerFactory, file_kv: str) -> list[str]:
    """``--profile PATH`` for an SLA planner over mocker workers: the profile of the mocker they
    run, measured now (``planner_profile.py``), unless the operator named a profile."""
    named = "--profile" in shlex.split(args.planner_args) or os.environ.get("DYN_PLANNER_PROFILE")
    if args.planner != "sla" or args.engine != "mocker" or named:
        return []
    path = Path(file_kv).parent / f"{Path(file_kv).name}-planner-profile.json"
    prefill = workers.engine_flags(ROLE_PREFILL) if pools.disaggregated else None
    decode = workers.engine_flags(ROLE_DECODE if pools.disaggregated else ROLE_AGG)
    return ["--profile", str(write_profile(path, prefill, decode))]


def scaling_budget(args: argparse.Namespace, pools: Pools) -> dict[str, PoolBudget]:
    """pool -> what the scaler may run: up to ``--max-workers`` each, never fewer than one
    serving worker (the planner's minimum is its own; this only stops a stray key)."""
    if pools.disaggregated:
        return {POOL_PREFILL: PoolBudget(0, args.max_workers), POOL_DECODE: PoolBudget(1, args.max_workers)}
    return {POOL_AGG: PoolBudget(1, args.max_workers)}


def scaling_templates(pools: Pools, workers: WorkerFactory) -> dict[str, PoolTemplate]:
    roles = [ROLE_PREFILL, ROLE_DECODE] if pools.disaggregated else [ROLE_AGG]
    return {
        role: PoolTemplate(role, child_name(role, 0).rsplit("-", 1)[0], lambda i, r=role: workers.spec(r, i))
        for role in roles
    }


def resolve_scaling(args: argparse.Namespace) -> None:
    """Checks the scaling flags; with a planner and no ``--workers``, an agg cluster starts at
    ``--min-workers`` (the planner grows it)."""
    if not (args.planner or args.accept_scaling):
        return
    if args.min_workers < 1:
        raise ConfigError("--min-workers must be 1 or more")
    if args.max_workers < args.min_workers:
        raise ConfigError(f"--max-workers ({args.max_workers}) must be at least --min-workers ({args.min_workers})")
    disagg = args.prefill_workers is not None or args.decode_workers is not None
    if not disagg and args.workers is None:
        args.workers = args.min_workers
    for flag, value in (("--workers", args.workers), ("--decode-workers", args.decode_workers),
                        ("--prefill-workers", args.prefill_workers)):
        if value is not None and value > args.max_workers:
            raise ConfigError(f"{flag} {value} is above --max-workers {args.max_workers}")


async def start_scaler(
    args: argparse.Namespace, supervisor: Supervisor, pools: Pools, workers: WorkerFactory, file_kv: str, namespace: str
) -> tuple[Scaler, DistributedRuntime]:
    """The scaler and the runtime it drains workers and holds its record with (file discovery,
    no event plane: it only reads and writes keys and calls ``drain``)."""
    settings = RuntimeSettings(
        namespace=namespace, discovery_backend="file", file_kv=file_kv, event_plane="zmq",
        security=security_from_args(args),  # it calls the workers' drain: it needs the cluster token
    )
    runtime = await DistributedRuntime.create(settings, events=False)
    scaler = Scaler(
        supervisor, runtime, scaling_templates(pools, workers), scaling_budget(args, pools),
        drain_timeout_s=args.scale_drain_timeout, stop_grace_s=args.shutdown_grace, ready_timeout_s=args.ready_timeout,
    )
    try:
        await scaler.start()
    except BaseException:
        await runtime.shutdown(grace_s=0)
        raise
    return scaler, runtime


async def start_failed_workers(
    args: argparse.Namespace, supervisor: Supervisor, file_kv: str, namespace: str
) -> tuple[FailedWorkers, DistributedRuntime]:
    """The failed-worker records and restart requests (``failed.py``), on their own runtime
    (file discovery, no event plane, no listener: it only reads and writes keys)."""
    settings = RuntimeSettings(
        namespace=namespace, discovery_backend="file", file_kv=file_kv, event_plane="zmq",
        security=security_from_args(args),
    )
    runtime = await DistributedRuntime.create(settings, events=False)
    failed = FailedWorkers(supervisor, runtime)
    try:
        await failed.start()
    except BaseException:
        await runtime.shutdown(grace_s=0)
        raise
    supervisor.on_change = failed.changed
    return failed, runtime


def child_name(role: str, index: int) -> str:
    """``worker-0`` for agg workers (as before pools existed), ``prefill-0``/``decode-0`` otherwise."""
    return f"worker-{index}" if role == ROLE_AGG else f"{role}-{index}"


def ready_models(body: dict, pools: Pools) -> list[str] | None:
    """The served (base) model names once /health shows the cluster whole, else None: the model's
    ``ready`` workers are its decode (or agg) workers, its ``prefill_ready`` the prefill pool's."""
    models = [m for m in body.get("models", []) if not m.get("lora")]
    if not models:
        return None
    serving = pools.decode if pools.disaggregated else pools.agg
    if sum(int(m.get("ready", 0)) for m in models) < serving:
        return None
    if pools.prefill and sum(int(m.get("prefill_ready", 0)) for m in models) < pools.prefill:
        return None
    return [m["model"] for m in models]


async def _wait_ready(target: HttpTarget, pools: Pools, timeout_s: float, stop: asyncio.Event) -> list[str] | None:
    """The served model names once the frontend sees every pool ready; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        body = await asyncio.to_thread(target.health)
        if body is not None:
            models = ready_models(body, pools)
            if models:
                return models
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass
    return None


def _banner(
    base_url: str, model: str, log_dir: Path | None, file_kv: str, pools: Pools, auth: str = "", encode_workers: int = 0
) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    lines = [f"dynamod is up: {pools.describe()} serving {model!r}"]
    if pools.disaggregated:
        lines.append(f"  prefill:    {pools.prefill} worker(s), component {PREFILL_COMPONENT!r}"
                     + ("" if pools.prefill else " (none: decode workers prefill locally)"))
        lines.append(f"  decode:     {pools.decode} worker(s), component {DECODE_COMPONENT!r}")
    if encode_workers:
        lines.append(f"  encode:     {encode_workers} worker(s), component {ENCODER_COMPONENT!r} (images)")
    lines += [
        f"  OpenAI API: {base_url}/v1",
        f"  try:        curl -s {base_url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{body}'",
        f"  discovery:  {file_kv}",
    ]
    if log_dir is not None:
        lines.append(f"  logs:       {log_dir}")
    lines.append("  stop:       Ctrl-C")
    return "\n".join(lines)


def _curl_auth(target: HttpTarget) -> str:
    """The banner's curl header for a frontend that asks for a key (never the key itself)."""
    if target.api_key_env:
        return " -H \"Authorization: Bearer ${DYN_API_KEY%%,*}\""
    return " -H 'Authorization: Bearer YOUR_KEY'" if target.api_key_file else ""


async def _set_when(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    """Runs the cluster until ``stop`` (or a crash loop); holds this run's directory locks
    (``cluster_lock.py``) until the end, so a second ``up`` on them is refused, not merged."""
    locks: list[ClusterLock] = []
    try:
        return await _run(args, stop, locks)
    finally:
        for lock in locks:
            lock.release()


def acquire_locks(args: argparse.Namespace, file_kv: str, log_dir: Path | None, locks: list[ClusterLock]) -> None:
    """The discovery directory's lock, and the log directory's when ``--log-dir`` names one
    (the default sits beside the discovery directory, so its lock covers it)."""
    host = probe_host(args.http_host)
    owner = {"url": f"{host}:{args.http_port}", "file_kv": file_kv, "log_dir": str(log_dir) if log_dir else None}
    wanted = [ClusterLock(Path(file_kv), "--file-kv")]
    if args.log_dir and log_dir is not None:
        wanted.append(ClusterLock(log_dir, "--log-dir"))
    for lock in wanted:
        lock.acquire(owner)
        locks.append(lock)


async def _run(args: argparse.Namespace, stop: asyncio.Event, locks: list[ClusterLock]) -> int:
    security_from_args(args)  # a bad security flag is one error line now, not a crash loop of children
    check_owned({"--worker-args": args.worker_args, "--prefill-args": args.prefill_args,
                 "--decode-args": args.decode_args, "--frontend-args": args.frontend_args,
                 "--planner-args": args.planner_args})
    os.environ.update(security_env(args))  # children inherit the flags (paths and switches, no secrets)
    resolve_scaling(args)
    pools = resolve_pools(args)
    policy = crash_policy(args)
    file_kv = args.file_kv or default_file_kv_dir()
    namespace = args.namespace or os.environ.get("DYN_NAMESPACE") or DEFAULT_NAMESPACE
    await asyncio.to_thread(Path(file_kv).mkdir, parents=True, exist_ok=True)
    log_dir = None if args.log_to_console else Path(args.log_dir or Path(file_kv).parent / "logs")
    acquire_locks(args, file_kv, log_dir, locks)  # before the port: a second `up` hears which one runs
    if not _port_free(args.http_host, args.http_port):
        raise ConfigError(
            f"port {args.http_port} on {args.http_host} is in use (another `dynamod up`?); pick one with --http-port"
        )
    workers = WorkerFactory(args, *runtime_flags(file_kv, namespace))
    # In a thread: with `--planner sla` it measures the workers' mocker first (a few seconds).
    specs = await asyncio.to_thread(build_specs, args, file_kv, namespace, workers)
    if args.log_backups < 0:
        raise ConfigError("--log-backups must be 0 or more")
    supervisor = Supervisor(
        specs, log_dir, crash_policy=policy, report=sys.stderr,
        log_max_bytes=args.log_max_bytes, log_backups=args.log_backups,
    )
    target = frontend_target(args.http_host, args.http_port, shlex.split(args.frontend_args))
    base_url = target.base_url
    # Either Ctrl-C/SIGTERM or a child in a crash loop ends the cluster.
    halt = asyncio.Event()
    watchers = [asyncio.create_task(_set_when(stop, halt)), asyncio.create_task(_set_when(supervisor.gave_up, halt))]
    scaling: tuple[Scaler, DistributedRuntime] | None = None
    if args.planner or args.accept_scaling:
        # Before the children: the planner's local connector waits for the scaler's record.
        scaling = await start_scaler(args, supervisor, pools, workers, file_kv, namespace)
    failed: tuple[FailedWorkers, DistributedRuntime] | None = None
    sd_writer: PrometheusSdWriter | None = None
    try:
        failed = await start_failed_workers(args, supervisor, file_kv, namespace)
        if args.prometheus_sd is not None:
            sd_writer = PrometheusSdWriter(supervisor, args.prometheus_sd, file_kv, namespace)
            await sd_writer.start()
        await supervisor.start()
        for child in supervisor.children:
            logger.info("cluster child name=%s pid=%s", child.spec.name, child.pid)
        models = await _wait_ready(target, pools, args.ready_timeout, halt)
        if models:
            print(_banner(base_url, models[0], log_dir, file_kv, pools, _curl_auth(target), args.encode_workers), flush=True)
        elif not halt.is_set():
            print(
                f"dynamod up: the cluster is not ready after {args.ready_timeout:.0f}s; still trying. "
                f"Frontend: {base_url}; logs: {log_dir or 'console'}",
                file=sys.stderr,
                flush=True,
            )
        await halt.wait()
        if supervisor.crash_loop is None:
            print("dynamod up: stopping (frontend first, then workers)", file=sys.stderr, flush=True)
    finally:
        for task in watchers:
            task.cancel()
        if sd_writer is not None:
            await sd_writer.close()  # empty before the children stop: a stopped cluster is not "down"
        if scaling is not None:
            # No more workers come or go once stopping; the record goes with the scaler's lease.
            await scaling[0].close()
            await scaling[1].shutdown(grace_s=0)
        if failed is not None:
            await failed[0].close()
            await failed[1].shutdown(grace_s=0)  # the failed-worker records go with its lease
        # Frontend first (it finishes its streams), then the workers that serve them, and the
        # prefill pool last: decode workers may still be reading KV blocks from it.
        # The planner goes first of all: it must not ask for workers while they are stopping.
        frontends = frontend_names(args.num_frontends)
        names = [c.spec.name for c in supervisor.children if c.spec.name not in (*frontends, PLANNER)]
        prefill = [n for n in names if n.startswith(f"{ROLE_PREFILL}-")]
        serving = [n for n in names if n not in prefill]
        await supervisor.stop([[PLANNER], frontends, serving, prefill], args.shutdown_grace)
    if supervisor.crash_loop is not None:
        raise CrashLoopError(supervisor.crash_loop.message())
    return 0
