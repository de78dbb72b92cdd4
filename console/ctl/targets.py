"""``dynamoctl targets``: where the cluster's ``/metrics`` are, for Prometheus outside Kubernetes.

    dynamoctl targets                         a table: address, namespace, role, component, worker id, model
    dynamoctl targets --prometheus            Prometheus file_sd JSON on stdout
    dynamoctl targets --prometheus -o PATH    the same, written atomically to PATH (only when it changed)

Reads discovery (any cluster dynamoctl reaches: ``dynamod up`` on this host, etcd, SSH clusters'
etcd) once; the target groups and their labels are ``shared/observability/file_sd.py``'s, the same
``dynamod up --prometheus-sd PATH`` keeps current. Run it from cron or a systemd timer for a cluster
`up` does not supervise; ``deploy/prometheus/prometheus-file-sd.yml`` is the scrape config that
reads the file (with the cluster token, when the cluster has one).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dynamod.console.ctl.store import command_store
from dynamod.console.settings import settings_from_args
from dynamod.shared.observability.file_sd import TargetGroup, read_target_groups, render, write_file

EXIT_OK = 0
EXIT_NO_TARGETS = 1
COLUMNS = ("TARGET", "NAMESPACE", "ROLE", "COMPONENT", "WORKER ID", "MODEL", "PATH")


def add_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds ``targets`` to dynamoctl's subcommands (``conn``: the connection flags)."""
    t = sub.add_parser("targets", parents=[conn], help="the cluster's /metrics addresses (Prometheus file_sd with --prometheus)")
    t.add_argument("--prometheus", action="store_true", help="print Prometheus file_sd JSON instead of a table")
    t.add_argument("--output", "-o", metavar="PATH",
                   help="with --prometheus: write the JSON to PATH atomically (Prometheus re-reads it) instead of stdout")
    t.add_argument("--allow-empty", action="store_true",
                   help="succeed with no targets (an empty list) instead of exiting 1 [default: exit 1]")


def rows(groups: list[TargetGroup]) -> list[tuple[str, ...]]:
    out = []
    for g in groups:
        labels = g["labels"]
        out.append((
            ",".join(g["targets"]), labels.get("namespace", "-"), labels.get("role", "-"), labels.get("component", "-"),
            labels.get("worker_id", "-"), labels.get("model", "-"), labels.get("__metrics_path__", "/metrics"),
        ))
    return out


def format_table(groups: list[TargetGroup]) -> str:
    table = [COLUMNS, *rows(groups)]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table) + "\n"


async def targets(args: argparse.Namespace) -> int:
    if args.output and not args.prometheus:
        print("dynamoctl: error: --output writes the --prometheus JSON; add --prometheus", file=sys.stderr)
        return 2
    namespace = settings_from_args(args).namespace
    async with command_store(args) as store:
        groups = await read_target_groups(store, namespace)
    if not groups and not args.allow_empty:
        # An empty file would silently drop every target Prometheus had: say so instead.
        where = f"namespace {namespace!r}" if namespace else "any namespace"
        print(f"dynamoctl: error: no instance with a /metrics address in {where} (is the cluster up?); "
              "--allow-empty writes an empty list anyway", file=sys.stderr)
        return EXIT_NO_TARGETS
    if not args.prometheus:
        sys.stdout.write(format_table(groups))
    elif args.output:
        write_file(args.output, groups)
    else:
        sys.stdout.write(render(groups))
    return EXIT_OK
