"""``dynamoctl trace REQUEST_ID [--json]``: one request's timeline, gathered from the cluster.

    dynamoctl trace ID             the waterfall: spans under their parents, bars on one time scale
    dynamoctl trace ID --json      {"request_id", "trace_id", "spans": [...]} sorted by start

The request id is the one the frontend echoes in ``x-request-id`` (or that the client sent). The
spans come from every frontend (found as the console's scraper finds them, read with the same
credentials) and every worker's ``traces`` control endpoint (``actions/traces.py``); a source that
does not answer is named on stderr and the rest is shown. A request no process knows exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from dynamod.console.actions.control import ControlClient
from dynamod.console.actions.traces import TraceGatherer
from dynamod.console.collectors.traces import frontend_http, frontend_trace_urls, guessed_trace_urls
from dynamod.console.ctl.commands import action_runtime
from dynamod.console.settings import settings_from_args
from dynamod.console.state.cluster import ClusterState
from dynamod.console.waterfall import render_text
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import instance_key
from dynamod.shared.security.printable import printable

EXIT_OK = 0


def add_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds ``trace`` to dynamoctl's subcommands (``conn``: the connection flags)."""
    t = sub.add_parser("trace", parents=[conn], help="one request's timeline (spans from every frontend and worker)")
    t.add_argument("request_id", metavar="REQUEST_ID", help="the request's x-request-id")
    t.add_argument("--json", action="store_true", help='print {"request_id", "trace_id", "spans": [...]} instead')
    t.add_argument("--width", type=int, default=None,
                   help="columns of the waterfall [default: the terminal's, 80 when not a terminal]")


def state_of(records: list[Instance]) -> ClusterState:
    """A cluster picture of the listed instances alone: what ``frontend_metric_urls`` reads."""
    state = ClusterState()
    for r in records:
        state.put_instance(instance_key(r.namespace, r.component, r.endpoint, r.instance_id), r)
    return state


def output_width(asked: int | None) -> int:
    if asked is not None:
        return max(40, asked)
    return shutil.get_terminal_size((80, 24)).columns if sys.stdout.isatty() else 80


async def trace(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    async with action_runtime(args) as rt:
        control = ControlClient(rt, namespace=settings.namespace)
        try:
            records = await control.instances()
            urls = frontend_trace_urls(state_of(records), settings.frontend_urls)
            gatherer = TraceGatherer(control, lambda: urls, frontend_http(settings, timeout_s=min(args.timeout, 5.0)),
                                     guessed=guessed_trace_urls(settings))
            found = await gatherer.gather(args.request_id)
        finally:
            await control.close()
    for note in found.notes:
        print(f"dynamoctl: note: {printable(note)}", file=sys.stderr)
    if args.json:
        sys.stdout.write(json.dumps(found.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(found.request_id, found.trace_id, found.spans, output_width(args.width)))
    return EXIT_OK

