"""``dynamoctl``: the console's actions as commands for scripts and SSH sessions.

    dynamoctl status [--json] [--pools]            every instance: id, component, role, status, model, LoRAs, node, pid, load
                                                   (and, with prefill/decode pools, a per-pool summary; the
                                                   workers `dynamod up` gave up on, as failed)
    dynamoctl restart NAME                         start again a worker `dynamod up` gave up on (crash loop)
    dynamoctl drain|sleep|wake|clear-kv INSTANCE   one worker (id in hex, or a unique prefix of it);
                                                   clear-kv --tier gpu|host|disk clears one KV tier
    dynamoctl lora load INSTANCE NAME SOURCE       load a LoRA adapter from a path or URI
    dynamoctl lora unload INSTANCE NAME
    dynamoctl lora list [INSTANCE]
    dynamoctl watch [--json|--raw]                 cluster events as lines, JSON, or raw recordings
    dynamoctl planner status [--json]              per pool: ready vs desired, override, predicted load, SLA
    dynamoctl planner decisions [--follow]         the planner's decisions and their reasons
    dynamoctl scale POOL N | POOL --clear          hold a pool at N replicas (override), or release it
    dynamoctl intent list | clear NAME             drain/sleep/LoRAs kept per worker name; forget a gone one's
    dynamoctl targets [--prometheus [-o PATH]]     the cluster's /metrics addresses (Prometheus file_sd JSON)
    dynamoctl trace REQUEST_ID [--json]            one request's timeline: its spans from every frontend and
                                                   worker as a waterfall (or JSON), by its x-request-id
    dynamoctl cluster up|down|status|logs --inventory FILE

Connection flags (``--discovery``, ``--etcd``, ``--nats``, ``--namespace``) default to finding a
``dynamod up`` cluster on this machine; a frontend with API keys is read with ``DYN_API_KEY`` or
``--api-key-file``. Failures print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable

from dynamod.console.settings import add_connection_args
from dynamod.shared.cli_parser import ArgumentParser
from dynamod.shared.errors import DynamoError
from dynamod.shared.security.printable import printable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _connection_parent() -> argparse.ArgumentParser:
    """Connection flags accepted before or after the subcommand; SUPPRESS keeps a value given
    before the subcommand from being reset by the subparser's default."""
    parent = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS, allow_abbrev=False)
    add_connection_args(parent)
    return parent


def build_parser() -> argparse.ArgumentParser:
    conn = _connection_parent()
    p = ArgumentParser(
        prog="dynamoctl",
        description="Operate a dynamod cluster from the shell: status, worker actions, events, SSH cluster admin.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(__doc__ or "").split("\n\n")[1],
    )
    add_connection_args(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the cluster to answer [default 10]")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("status", parents=[conn], help="list every instance with its status and load")
    s.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    s.add_argument("--pools", action="store_true",
                   help="print only the per-pool summary (agg/prefill/decode: load, KV, KV transfers)")
    s.add_argument("--all", action="store_true", help="include instances that just went away")
    s.add_argument("--wait", type=float, default=2.0, help="seconds to collect load metrics [default 2]")

    from dynamod.console.ctl import intent, planner, restart, targets, trace, worker_actions

    worker_actions.add_commands(sub, conn)
    worker_actions.add_lora_commands(sub, conn)

    w = sub.add_parser("watch", parents=[conn], help="print cluster events as they happen")
    w.add_argument("--json", action="store_true", help="one JSON object per event")
    w.add_argument("--raw", action="store_true", help="every collector input as a replayable recording line")
    w.add_argument("--kind", action="append", default=[], help="only these event kinds (repeatable)")
    w.add_argument("--duration", type=float, default=None, help="stop after this many seconds")

    targets.add_commands(sub, conn)
    planner.add_commands(sub, conn)
    intent.add_commands(sub, conn)
    restart.add_commands(sub, conn)
    trace.add_commands(sub, conn)

    c = sub.add_parser("cluster", help="start, stop, check and read logs of roles on hosts over SSH")
    csub = c.add_subparsers(dest="cluster_command", metavar="up|down|status|logs")
    for name, text in (("up", "start every role of the inventory"), ("down", "stop every role"),
                       ("status", "state and /health of every role"), ("logs", "recent log lines of every role")):
        cp = csub.add_parser(name, help=text)
        cp.add_argument("--inventory", "-i", required=True, help="inventory TOML file")
        cp.add_argument("--host", help="only this host (name or address)")
        cp.add_argument("--role", help="only this role (role or role name)")
        if name in ("up", "down", "status"):
            cp.add_argument("--json", action="store_true")
        if name == "up":
            cp.add_argument("--wait", type=float, default=60.0, help="seconds to wait for /health [default 60]")
        if name == "logs":
            cp.add_argument("--lines", "-n", type=int, default=100, help="lines per role [default 100]")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "lora" and args.lora_command is None:
        parser.parse_args(["lora", "--help"])
    if args.command == "cluster" and args.cluster_command is None:
        parser.parse_args(["cluster", "--help"])
    if args.command == "planner" and args.planner_command is None:
        parser.parse_args(["planner", "--help"])
    if args.command == "intent" and args.intent_command is None:
        parser.parse_args(["intent", "--help"])
    from dynamod.shared.observability.logging import configure_logging

    configure_logging("warning" if args.command not in ("watch", "planner") else "error")
    runner = _dispatch(args)
    try:
        return asyncio.run(runner())
    except KeyboardInterrupt:
        return 130
    except DynamoError as exc:
        # Errors quote what the cluster said (names, replies): shown, never obeyed, by the terminal.
        print(f"dynamoctl: error: {printable(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, TimeoutError) as exc:
        print(f"dynamoctl: error: {printable(exc or type(exc).__name__)}", file=sys.stderr)
        return EXIT_FAILED


def _dispatch(args: argparse.Namespace) -> Callable[[], Awaitable[int]]:
    from dynamod.console.ctl import commands, intent, planner, restart, targets, trace

    if args.command == "cluster":
        return lambda: commands.cluster(args)
    table: dict[str, Callable[[argparse.Namespace], Awaitable[int]]] = {
        "status": commands.status,
        "drain": commands.action,
        "sleep": commands.action,
        "wake": commands.action,
        "clear-kv": commands.action,
        "lora": commands.action,
        "watch": commands.watch,
        "planner": planner.planner,
        "scale": planner.scale,
        "intent": intent.intent,
        "restart": restart.restart,
        "targets": targets.targets,
        "trace": trace.trace,
    }
    fn = table[args.command]
    return lambda: fn(args)


if __name__ == "__main__":
    sys.exit(main())
