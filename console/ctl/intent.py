"""``dynamoctl intent list|clear``: the operator's kept wishes per worker name.

    dynamoctl intent list [--namespace NS] [--json]     drain/sleep and LoRAs kept per worker name
    dynamoctl intent clear NAME [--component C] [--namespace NS]

A worker re-applies its intent (``v1/intent/{ns}/{component}/{worker_name}``, no lease) when it
starts again under the same name; ``wake`` and ``lora unload`` clear it on a running worker. A
worker name that is gone for good (a host retired, a pool renamed) leaves its intent behind for
the next process that takes the name: ``clear`` removes it. Clearing a running worker's intent
does not change the worker; it only forgets the wish for its next start.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from dynamod.console.ctl.store import command_store
from dynamod.console.present import format_table
from dynamod.console.settings import settings_from_args
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.runtime.intent import StoredIntent, clear_intent, list_intents
from dynamod.shared.security.printable import printable

EXIT_OK = 0
EXIT_FAILED = 1


def add_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds ``intent list|clear`` to dynamoctl's subcommands (``conn``: the connection flags)."""
    it = sub.add_parser("intent", help="operator intent kept per worker name: list, clear")
    isub = it.add_subparsers(dest="intent_command", metavar="list|clear")
    ls = isub.add_parser("list", parents=[conn], help="drain/sleep and LoRA adapters kept for each worker name")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cl = isub.add_parser("clear", parents=[conn], help="forget a worker name's intent (for a worker that is gone)")
    cl.add_argument("worker_name", metavar="NAME", help="the worker name (`dynamoctl intent list` shows them)")
    cl.add_argument("--component", help="the worker's component, when the name is kept under more than one")


def _row(item: StoredIntent) -> dict[str, Any]:
    out: dict[str, Any] = {"namespace": item.namespace, "component": item.component, "worker_name": item.worker_name}
    if item.intent is None:
        return {**out, "error": item.error}
    return {**out, **msgspec.to_builtins(item.intent)}


async def intent(args: argparse.Namespace) -> int:
    if args.intent_command == "clear":
        return await clear(args)
    async with command_store(args) as store:
        items = await list_intents(store, settings_from_args(args).namespace)
    if args.json:
        sys.stdout.write(json.dumps([_row(i) for i in items], indent=2) + "\n")
        return EXIT_OK
    if not items:
        print("no intent kept")
        return EXIT_OK
    # Names, LoRAs and set-by come from discovery: printed through ``printable`` (format_table).
    rows = []
    for i in items:
        if i.intent is None:
            rows.append((i.namespace, i.component, i.worker_name, f"unreadable: {i.error}", "", "", ""))
            continue
        w = i.intent
        rows.append((i.namespace, i.component, i.worker_name, w.status, str(w.sleep_level or "-"),
                     ",".join(sorted(w.loras)) or "-", w.set_by or "-"))
    print(format_table(("NAMESPACE", "COMPONENT", "WORKER", "STATUS", "SLEEP", "LORAS", "SET BY"), rows))
    return EXIT_OK


async def clear(args: argparse.Namespace) -> int:
    async with command_store(args) as store:
        matches = [i for i in await list_intents(store, settings_from_args(args).namespace)
                   if i.worker_name == args.worker_name and (args.component is None or i.component == args.component)]
        if not matches:
            print(f"dynamoctl: no intent kept for worker {printable(args.worker_name)!r}", file=sys.stderr)
            return EXIT_FAILED
        if len(matches) > 1:
            where = printable(", ".join(f"{m.namespace}/{m.component}" for m in matches))
            raise InvalidRequestError(
                f"worker name {args.worker_name!r} has intent under {where}: pick one with --component/--namespace"
            )
        m = matches[0]
        await clear_intent(store, m.namespace, m.component, m.worker_name)
    print(printable(f"cleared intent of {m.namespace}/{m.component}/{m.worker_name}"))
    return EXIT_OK
