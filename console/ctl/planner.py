"""``dynamoctl planner status|decisions`` and ``dynamoctl scale``: the Scaling view as commands.

    dynamoctl planner status [--json]                        per pool: ready vs desired, override, budget,
                                                             live load (REQ/S, QUEUE, ISL, OSL), TTFT/ITL vs
                                                             the SLA, last decision
    dynamoctl planner decisions [--follow] [--limit N] [--json]
    dynamoctl scale POOL N [--namespace NS] [--reason TEXT]  hold POOL at N replicas (an override)
    dynamoctl scale POOL --clear [--namespace NS]            hand POOL back to the planner

``status`` reads the live figures from the planner's status record (what it measured over its last
interval), the same record and the same formatter as the console's Scaling view, so the two never
disagree and ``status`` needs no scrape of its own. ``status`` and ``scale`` need discovery only (a store opened for the command, no lease: an override
must outlive the command). ``decisions`` subscribes to the event plane, where decisions are
published live and not kept: without ``--follow`` it waits for the planner's next interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.console.actions.scaling import ScaleClient
from dynamod.console.collectors.discovery import DiscoveryCollector
from dynamod.console.ctl.store import command_store
from dynamod.console.present import (
    SCALING_COLUMNS,
    decision_line,
    format_table,
    global_router_line,
    scaling_record,
    scaling_row,
)
from dynamod.console.settings import ConsoleSettings, settings_from_args
from dynamod.console.state.cluster import ClusterState
from dynamod.shared.config import DEFAULT_NAMESPACE
from dynamod.shared.errors import DiscoveryError, InvalidRequestError
from dynamod.shared.events.plane import TOPIC_PLANNER_DECISIONS
from dynamod.shared.protocol.planner import PLANNER_COMPONENT, POOLS, PlannerDecision, decision_decoder
from dynamod.shared.security.printable import printable

if TYPE_CHECKING:
    from dynamod.shared.discovery.store import DiscoveryStore

EXIT_OK = 0
EXIT_FAILED = 1
DEFAULT_DECISIONS_WAIT_S = 30.0


def add_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds ``planner`` and ``scale`` to dynamoctl's subcommands (``conn``: the connection flags)."""
    pl = sub.add_parser("planner", help="the planner: its status per pool and its decisions")
    psub = pl.add_subparsers(dest="planner_command", metavar="status|decisions")
    st = psub.add_parser("status", parents=[conn], help="per pool: ready vs desired, override, live load and TTFT/ITL vs the SLA")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    de = psub.add_parser("decisions", parents=[conn], help="the planner's decisions with their reasons, as they come")
    de.add_argument("--follow", "-f", action="store_true", help="keep printing until interrupted")
    de.add_argument("--limit", "-n", type=int, default=None,
                    help="stop after N decisions [default: one interval's, one per pool; unlimited with --follow]")
    de.add_argument("--wait", type=float, default=None,
                    help="without --follow: give up after this many seconds [default 2 planner intervals, or 30]")
    de.add_argument("--json", action="store_true", help="one JSON object per decision (JSON lines)")

    sc = sub.add_parser("scale", parents=[conn], help="hold a pool at N replicas (an override the planner respects)")
    sc.add_argument("pool", help=f"the pool: {', '.join(POOLS)}")
    sc.add_argument("replicas", nargs="?", metavar="N", help="replicas to hold the pool at (0 or more)")
    sc.add_argument("--clear", action="store_true", help="delete the override: the planner sizes the pool again")
    sc.add_argument("--reason", default="", help="why (shown beside the override in the console and status)")
    sc.add_argument("--json", action="store_true")


def _settings(args: argparse.Namespace) -> ConsoleSettings:
    return settings_from_args(args)


async def _snapshot(store: DiscoveryStore, namespace: str | None) -> ClusterState:
    """One listing of discovery into a fresh picture: workers, planner status, overrides."""
    state = ClusterState()
    await DiscoveryCollector(store, state, namespace=namespace).sync()
    return state


def _dump(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


# -- planner ---------------------------------------------------------------------------------------


async def planner(args: argparse.Namespace) -> int:
    if args.planner_command == "decisions":
        return await decisions(args)
    return await status(args)


async def status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    async with command_store(args) as store:
        state = await _snapshot(store, settings.namespace)
    pools = state.scaling_pools()
    routers = state.global_routers()
    if args.json:
        _dump({
            "planners": [msgspec.to_builtins(s) for _, s in sorted(state.scaling.statuses.items())],
            "pools": [scaling_record(p) for p in pools],
            "global_routers": [
                {"instance": f"{g.instance_id:x}", "namespace": g.namespace, "status": g.status, "pools": g.pools,
                 "ready": g.ready, "planned": g.planned}
                for g in routers
            ],
        })
        return EXIT_OK
    if not pools and not routers:
        print(f"no pools and no planner ({settings.describe()})")
        return EXIT_OK
    if pools:
        print(format_table(SCALING_COLUMNS, [scaling_row(p) for p in pools]))
    overrides = [p for p in pools if p.override is not None]
    if overrides:
        print()
        for p in overrides:
            o = p.override
            assert o is not None
            who = f" by {o.set_by}" if o.set_by else ""
            why = f": {o.reason}" if o.reason else ""
            print(printable(f"override {p.key} = {o.replicas}{who}{why}"))  # set_by and reason: anyone's text
    unplanned = sorted({p.namespace for p in pools if not p.planner})
    if unplanned:
        print(f"\nno planner running in: {', '.join(unplanned)}")
    if routers:
        print()
        for g in routers:
            print(printable(global_router_line(g)))
    return EXIT_OK


async def decisions(args: argparse.Namespace) -> int:
    from dynamod.shared.runtime.distributed import DistributedRuntime

    if args.limit is not None and args.limit < 1:
        raise InvalidRequestError(f"--limit must be 1 or more, got {args.limit}")
    settings = _settings(args)
    async with command_store(args) as store:
        state = await _snapshot(store, settings.namespace)
    statuses = state.scaling.statuses
    namespaces = [settings.namespace] if settings.namespace else sorted(set(statuses) | set(state.namespaces()))
    namespaces = namespaces or [DEFAULT_NAMESPACE]
    limit = args.limit
    if limit is None and not args.follow:
        # One interval: every planner publishes one decision per pool it sizes.
        limit = sum(len(statuses[ns].pools) for ns in namespaces if ns in statuses) or 1
    wait = args.wait
    if wait is None:
        intervals = [statuses[ns].interval_s for ns in namespaces if ns in statuses]
        wait = 2 * max(intervals) + 1 if intervals else DEFAULT_DECISIONS_WAIT_S
    try:
        rt = await asyncio.wait_for(DistributedRuntime.create(settings.runtime_settings(), events=True), args.timeout)
    except TimeoutError:
        raise DiscoveryError(f"no answer from {settings.describe()} within {args.timeout:g}s") from None
    queue: asyncio.Queue[PlannerDecision] = asyncio.Queue(maxsize=1024)
    tasks: list[asyncio.Task[None]] = []
    try:
        assert rt.events is not None
        for ns in namespaces:
            sub = await rt.events.subscribe(ns, PLANNER_COMPONENT, TOPIC_PLANNER_DECISIONS)
            tasks.append(asyncio.create_task(_pump(sub, queue)))
        return await _print_decisions(queue, limit=limit, wait=None if args.follow else wait, as_json=args.json,
                                      where=", ".join(namespaces))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await rt.shutdown(grace_s=0.0)


async def _pump(sub: Any, queue: asyncio.Queue[PlannerDecision]) -> None:
    """Decodes one subscription into the queue; a message that is not a decision is reported and
    skipped. When the printer is far behind (full queue), the oldest decision is dropped."""
    try:
        async for msg in sub:
            try:
                decision = decision_decoder.decode(msg.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                print(f"dynamoctl: warning: unreadable planner decision: {exc}", file=sys.stderr)
                continue
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(decision)
    finally:
        with contextlib.suppress(Exception):
            await sub.close()


async def _print_decisions(queue: asyncio.Queue[PlannerDecision], *, limit: int | None, wait: float | None,
                           as_json: bool, where: str) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait if wait is not None else None
    printed = 0
    while limit is None or printed < limit:
        timeout = None if deadline is None else deadline - loop.time()
        if timeout is not None and timeout <= 0:
            break
        try:
            d = await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            break
        sys.stdout.write((msgspec.json.encode(d).decode() if as_json else printable(decision_line(d))) + "\n")
        sys.stdout.flush()
        printed += 1
    if printed == 0:
        print(f"dynamoctl: error: no planner decision within {wait:g}s in {where} (is a planner running?)",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


# -- scale -----------------------------------------------------------------------------------------


def _replicas(args: argparse.Namespace) -> int | None:
    """N from the command line, or None with ``--clear``; bad input raises with one line."""
    if args.clear:
        if args.replicas is not None:
            raise InvalidRequestError("give either N or --clear, not both")
        return None
    if args.replicas is None:
        raise InvalidRequestError(f"scale {args.pool}: give the replicas N, or --clear")
    try:
        return int(args.replicas)
    except ValueError:
        raise InvalidRequestError(f"replicas must be a whole number, got {args.replicas!r}") from None


async def scale(args: argparse.Namespace) -> int:
    replicas = _replicas(args)
    namespace = _settings(args).namespace or DEFAULT_NAMESPACE
    async with command_store(args) as store:
        client = ScaleClient(store)
        if replicas is None:
            result = await client.clear_override(namespace, args.pool)
        else:
            result = await client.set_override(namespace, args.pool, replicas, reason=args.reason)
    if args.json:
        _dump({"action": result.action, "pool": result.target, "ok": result.ok, "message": result.message, **result.data})
    elif result.ok:
        print(printable(result.message))
    else:
        print(printable(f"dynamoctl: error: {result.action} {result.target}: {result.message}"), file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAILED
