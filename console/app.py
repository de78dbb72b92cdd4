"""``dynamo-console``: the operator's terminal view of a dynamod cluster.

    dynamo-console                       # a `dynamod up` cluster on this machine, no flags
    dynamo-console --discovery etcd --etcd http://10.0.0.5:2379 --nats nats://10.0.0.5:4222
    dynamo-console --read-only --namespace prod
    dynamo-console --replay recording.jsonl   # look at a recorded cluster (dynamoctl watch --raw)

Logs go to a file (the screen belongs to the TUI): ``--log-file``, default
``/tmp/dynamod-UID/console.log``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.settings import add_connection_args, settings_from_args
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import RecordingSink, read_records, replay
from dynamod.shared.cli_parser import ArgumentParser
from dynamod.shared.errors import DynamoError


def default_log_file() -> str:
    return os.path.join(tempfile.gettempdir(), f"dynamod-{os.getuid()}", "console.log")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dynamo-console", description=(__doc__ or "").strip().split("\n\n")[0])
    add_connection_args(p)
    g = p.add_argument_group("console")
    g.add_argument("--read-only", action="store_true", help="hide and refuse every action (view only)")
    g.add_argument("--view", default="workers", help="view to open: topology, workers, models, events, router, scaling, requests [default workers]")
    g.add_argument("--refresh", type=float, default=0.5, help="screen refresh interval in seconds [default 0.5]")
    g.add_argument("--record", metavar="FILE", help="also write every collector input to FILE (JSON lines, replayable)")
    g.add_argument("--replay", metavar="FILE", help="show a recording instead of a live cluster (implies --read-only)")
    g.add_argument("--log-file", default=None, help=f"log file [default {default_log_file()}]")
    g.add_argument("--log-level", default=os.environ.get("DYN_LOG", "info"), help="log level [env DYN_LOG, default info]")
    return p


def _configure_logging(path: str, level: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level.upper() in logging.getLevelNamesMapping() else "INFO")


def main(argv: list[str] | None = None) -> int:
    from dynamod.console.tui.app import ConsoleApp

    args = build_parser().parse_args(argv)
    _configure_logging(args.log_file or default_log_file(), args.log_level)
    try:
        if args.replay:
            state = replay(read_records(args.replay))
            app = ConsoleApp(state, read_only=True, refresh_s=args.refresh, initial_view=args.view)
            app.run()
            return 0
        settings = settings_from_args(args)
        state = ClusterState()
        record_file = open(args.record, "a", encoding="utf-8", buffering=1 << 16) if args.record else None  # noqa: SIM115
        try:
            sink = RecordingSink(state, record_file.write) if record_file else None
            connection = ClusterConnection(settings, state, sink)
            app = ConsoleApp(
                state, connection=connection, read_only=args.read_only, refresh_s=args.refresh, initial_view=args.view
            )
            app.run()
        finally:
            if record_file:
                record_file.close()
    except (DynamoError, OSError, ValueError) as exc:
        print(f"dynamo-console: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
