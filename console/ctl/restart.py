"""``dynamoctl restart NAME``: start a worker ``dynamod up`` gave up on again; the failed list.

    dynamoctl restart NAME [--namespace NS]     e.g. worker-1 after its crash loop

``dynamod up`` stops restarting a worker that keeps dying, while the rest of its pool serves
(issue 24 item 6), and records it in discovery (``shared/protocol/supervisor.py``). This asks the
supervisor to start it again with a fresh crash count and waits, up to ``--timeout``, until the
supervisor has taken the request (the failed record is gone). ``failed_rows`` is what
``dynamoctl status`` prints under its table.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import time
from typing import Any

import msgspec

from dynamod.console.ctl.store import command_store
from dynamod.console.settings import settings_from_args
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import DynamoError, InvalidRequestError
from dynamod.shared.protocol.supervisor import (
    FailedWorker,
    RestartRequest,
    failed_key,
    failed_prefix,
    restart_key,
)

EXIT_OK = 0
FAILED_COLUMNS = ("FAILED WORKER", "POOL", "LAST DEATH", "DEATHS", "LOG")
DEFAULT_NAMESPACE = "dynamo"
POLL_S = 0.1


def add_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds ``restart NAME`` to dynamoctl's subcommands (``conn``: the connection flags)."""
    r = sub.add_parser("restart", parents=[conn],
                       help="start again a worker `dynamod up` gave up on after a crash loop")
    r.add_argument("worker_name", metavar="NAME", help="the worker's name, as `dynamoctl status` lists it (worker-1)")


def _namespace(args: argparse.Namespace) -> str:
    return settings_from_args(args).namespace or DEFAULT_NAMESPACE


async def read_failed(store: DiscoveryStore, namespace: str) -> list[FailedWorker]:
    """The workers the namespace's supervisor gave up on, by name; undecodable records skipped."""
    out = []
    for _key, raw in sorted((await store.get_prefix(failed_prefix(namespace))).items()):
        try:
            out.append(msgspec.json.decode(raw, type=FailedWorker))
        except msgspec.DecodeError:
            continue
    return out


def failed_rows(failed: list[FailedWorker]) -> list[tuple[str, ...]]:
    """``dynamoctl status``'s table of failed workers (the console's collectors read the records)."""
    return [(f.name, f.pool or "-", f.reason or "-", str(f.crashes), f.log or "-") for f in failed]


async def restart(args: argparse.Namespace) -> int:
    name = args.worker_name
    namespace = _namespace(args)
    async with command_store(args) as store:
        if await store.get(failed_key(namespace, name)) is None:
            known = ", ".join(f.name for f in await read_failed(store, namespace)) or "none"
            raise InvalidRequestError(
                f"{name} is not a failed worker of namespace {namespace!r} (failed: {known}); `dynamod up` "
                "restarts a worker that dies by itself, and this restarts one it gave up on"
            )
        request = RestartRequest(name=name, by=f"dynamoctl ({getpass.getuser()})", ts=time.time())
        await store.put(restart_key(namespace, name), msgspec.json.encode(request))
        deadline = time.monotonic() + args.timeout
        while await store.get(failed_key(namespace, name)) is not None:
            if time.monotonic() >= deadline:
                await store.delete(restart_key(namespace, name))
                raise DynamoError(f"the supervisor did not take the restart of {name} within {args.timeout:g}s "
                                  "(is its `dynamod up` running?)")
            await asyncio.sleep(POLL_S)
    print(f"{name}: restarted (a fresh crash count; `dynamoctl status` shows it once it serves)")
    return EXIT_OK
