"""The bodies of the dynamoctl subcommands. Each returns an exit code and prints its own output;
cluster-side failures come back as one line and exit code 1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from dynamod.console.actions.control import ActionResult, ControlClient
from dynamod.console.actions.specs import LIST_LORAS
from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.ctl.restart import FAILED_COLUMNS, failed_rows
from dynamod.console.present import (
    POOL_COLUMNS,
    format_table,
    pool_records,
    pool_row,
    status_records,
    status_table,
)
from dynamod.console.settings import ConsoleSettings, settings_from_args
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.pools import is_disaggregated
from dynamod.console.state.recording import RecordingSink
from dynamod.console.state.records import ClusterEvent, fmt_id
from dynamod.shared.errors import DiscoveryError, DynamoError
from dynamod.shared.protocol import control
from dynamod.shared.security.printable import printable

if TYPE_CHECKING:
    from dynamod.shared.runtime.distributed import DistributedRuntime

EXIT_OK = 0
EXIT_FAILED = 1


def _settings(args: argparse.Namespace) -> ConsoleSettings:
    return settings_from_args(args)


@contextlib.asynccontextmanager
async def action_runtime(args: argparse.Namespace) -> AsyncIterator[DistributedRuntime]:
    """A runtime without an event plane: actions only need discovery and the request plane."""
    from dynamod.shared.runtime.distributed import DistributedRuntime

    settings = _settings(args)
    try:
        rt = await asyncio.wait_for(DistributedRuntime.create(settings.runtime_settings(), events=False), args.timeout)
    except TimeoutError:
        raise DiscoveryError(
            f"no answer from {settings.discovery} discovery ({settings.discovery_target()}) within {args.timeout:g}s"
        ) from None
    try:
        yield rt
    finally:
        await rt.shutdown(grace_s=0.0)


@contextlib.asynccontextmanager
async def _collecting(args: argparse.Namespace, state: ClusterState, sink: Any = None, *, scrape: bool = True) -> AsyncIterator[ClusterConnection]:
    """Runs the console's collectors into ``state`` for the duration of the block."""
    settings = _settings(args)
    conn = ClusterConnection(settings, state, sink, scrape=scrape, tick=True)
    task = asyncio.create_task(conn.run())
    try:
        ready = asyncio.create_task(conn.wait_ready(args.timeout))
        done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            ready.cancel()
            task.result()  # the connection gave up: raise its error
        try:
            ready.result()
        except TimeoutError:
            detail = state.connections.get("discovery")
            reason = f": {detail.detail}" if detail and detail.detail else ""
            raise DiscoveryError(f"cannot reach {settings.discovery} discovery ({settings.discovery_target()}) within {args.timeout:g}s{reason}") from None
        yield conn
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, DynamoError):
            await task


# -- status ----------------------------------------------------------------------------------------


async def status(args: argparse.Namespace) -> int:
    state = ClusterState()
    async with _collecting(args, state) as conn:
        deadline = time.monotonic() + max(0.0, args.wait)
        # Load arrives at least once a second per worker; stop early once every worker reported,
        # its cached blocks were read (kv_dump) and the frontends were read once (their TTFT/ITL,
        # or why there are none).
        while time.monotonic() < deadline:
            workers = state.worker_list(include_gone=False)
            scraped = conn.scraper is None or conn.scraper.rounds > 0
            seeded = all(w.stats.kv_seeded for w in workers if control.KV_DUMP in w.endpoints)
            if workers and scraped and seeded and all(w.stats.loads for w in workers):
                break
            await asyncio.sleep(0.05)
    for reason in state.metric_problems():
        # A latency figure is missing for a reason the operator can fix: say so (stderr keeps
        # --json output clean for scripts).
        print(f"dynamoctl: warning: no TTFT/ITL figures: {printable(reason)}", file=sys.stderr)
    pools = state.pools()
    if args.pools:
        if args.json:
            _dump(pool_records(state))
        elif pools:
            print(format_table(POOL_COLUMNS, [pool_row(p) for p in pools.values()]))
        else:
            print(f"no workers ({_settings(args).describe()})")
        return EXIT_OK
    if args.json:
        _dump(status_records(state, include_gone=args.all))
        return EXIT_OK
    columns, rows = status_table(state, include_gone=args.all)
    # Workers `dynamod up` gave up on: no instance, still the operator's (from the same listing).
    failed = [e.record for e in state.failed()]
    if not rows and not failed:
        print(f"no instances ({_settings(args).describe()})")
        return EXIT_OK
    if rows:
        print(format_table(columns, rows))
    if failed:
        print(("\n" if rows else "") + format_table(FAILED_COLUMNS, failed_rows(failed)))
        print("not restarted after a crash loop; `dynamoctl restart NAME` tries again")
    if is_disaggregated(pools):
        # Which pool is short is the first question about a disaggregated cluster.
        print()
        print(format_table(POOL_COLUMNS, [pool_row(p) for p in pools.values()]))
    return EXIT_OK


def _dump(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


# -- worker actions --------------------------------------------------------------------------------


def _report(result: ActionResult, as_json: bool) -> int:
    """The worker's reply in one line. Its message is the worker's text: printed through
    ``printable`` so an escape sequence in it cannot act on the terminal (JSON escapes on its own)."""
    if as_json:
        _dump(result.to_dict())
    elif result.ok:
        print(f"{result.action} {printable(result.target)}: {printable(result.message)}")
    else:
        print(f"dynamoctl: error: {result.action} {printable(result.target)}: {printable(result.message)}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAILED


async def action(args: argparse.Namespace) -> int:
    """Any worker action: the spec and body its subcommand carries (``worker_actions.py``); ``lora
    list`` without an instance asks every worker."""
    async with action_runtime(args) as rt:
        client = ControlClient(rt, namespace=_settings(args).namespace)
        try:
            if args.action_spec is LIST_LORAS:
                return await _lora_list(client, args)
            return _report(await client.run(args.action_spec, args.instance, args.body_of(args)), args.json)
        finally:
            await client.close()


async def _lora_list(client: ControlClient, args: argparse.Namespace) -> int:
    if args.instance:
        targets: list[str | int] = [args.instance]
    else:
        targets = sorted({r.instance_id for r in await client.instances() if r.endpoint == LIST_LORAS.endpoint})
    results = list(await asyncio.gather(*(client.run(LIST_LORAS, t, control.EmptyRequest()) for t in targets)))
    failed = [r for r in results if not r.ok]
    rows: list[dict[str, Any]] = []
    for r in results:
        for lo in r.data.get("loras", []) if r.ok else []:
            rows.append({"instance": r.target, "name": lo.get("name", ""), "source": lo.get("source", ""), "lora_id": lo.get("lora_id")})
    if args.json:
        _dump({"loras": rows, "errors": [r.to_dict() for r in failed]})
    elif rows:
        print(format_table(("INSTANCE", "NAME", "SOURCE"), [(x["instance"], x["name"], str(x["source"])) for x in rows]))
    else:
        print("no LoRA adapters loaded" if results else "no worker serves list_loras")
    for r in failed:
        print(f"dynamoctl: error: lora list {printable(r.target)}: {printable(r.message)}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


# -- watch -----------------------------------------------------------------------------------------


def _event_line(ev: ClusterEvent) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ev.ts))
    who = f" {fmt_id(ev.instance_id)}" if ev.instance_id is not None else ""
    return f"{stamp} {ev.severity:<7} {ev.kind:<10}{who} {printable(ev.message)}"


async def watch(args: argparse.Namespace) -> int:
    state = ClusterState()
    kinds = set(args.kind)
    out = sys.stdout

    def on_event(ev: ClusterEvent) -> None:
        if kinds and ev.kind not in kinds:
            return
        out.write((json.dumps(ev.to_dict()) if args.json else _event_line(ev)) + "\n")
        out.flush()

    sink = None
    if args.raw:

        def write(line: str) -> None:
            out.write(line)
            out.flush()

        sink = RecordingSink(state, write)
    else:
        state.add_event_listener(on_event)
    async with _collecting(args, state, sink):
        if args.duration is not None:
            await asyncio.sleep(args.duration)
        else:
            await asyncio.Event().wait()
    return EXIT_OK


# -- cluster over SSH --------------------------------------------------------------------------------


async def cluster(args: argparse.Namespace) -> int:
    from dynamod.console.ctl.cluster.inventory import load_inventory
    from dynamod.console.ctl.cluster.ops import gather_logs, run_op

    inv = load_inventory(args.inventory)
    if args.cluster_command == "logs":
        for host, name, text in await gather_logs(inv, host=args.host, role=args.role, lines=args.lines):
            print(f"==> {host}/{name} <==")
            sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        return EXIT_OK
    results = await run_op(inv, args.cluster_command, host=args.host, role=args.role, wait_s=getattr(args, "wait", 60.0))
    if args.json:
        _dump([r.to_dict() for r in results])
    else:
        cols = ("HOST", "NAME", "ROLE", "MODE", "STATE", "PID", "HEALTH", "DETAIL")
        rows = [r.row() for r in results]
        print(format_table(cols, rows))
    bad = [r for r in results if not r.ok]
    if args.cluster_command == "status":
        bad += [r for r in results if r.state not in ("running",) and r not in bad]
    for r in bad:
        print(printable(f"dynamoctl: error: {r.host}/{r.name}: {r.state} {r.health} {r.detail}".rstrip()), file=sys.stderr)
    return EXIT_FAILED if bad else EXIT_OK
