"""The ``dynamod`` command: one binary, one role per process.

    dynamod --role agg|decode|prefill ...   node daemon hosting one engine
    dynamod --role encode ...               vision encoder for a VL model's images (encode pool)
    dynamod --role frontend ...             OpenAI HTTP frontend with routing
    dynamod --role router ...               standalone KV router
    dynamod up ...                          the embedded single-host cluster
    dynamod replay ...                      trace replay through the real router and mocker

Each role lives in its own package and exposes ``add_args(parser)`` and
``async run(args, stop_event) -> int``; the module is imported only when its role is chosen, so a
node without an engine's libraries still runs the others.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from dynamod import __version__
from dynamod.daemon.lifecycle import run_role
from dynamod.shared.cli_parser import ArgumentParser, unrecognized_message
from dynamod.shared.errors import DynamoError
from dynamod.shared.observability.logging import configure_logging
from dynamod.shared.observability.tracing_setup import configure_tracing

# role -> module implementing add_args/run
ROLES: dict[str, str] = {
    "agg": "dynamod.daemon.worker.main",
    "decode": "dynamod.daemon.worker.main",
    "prefill": "dynamod.daemon.worker.main",
    "encode": "dynamod.daemon.encode.main",
    "frontend": "dynamod.daemon.frontend.main",
    "router": "dynamod.daemon.router.main",
    "planner": "dynamod.daemon.planner.main",
    "global-router": "dynamod.daemon.global_router.main",
}
# subcommand -> module implementing add_args/run (or main(argv) for synchronous tools)
SUBCOMMANDS: dict[str, str] = {
    "up": "dynamod.daemon.supervisor.up",
    "replay": "dynamod.daemon.replay.main",
    "profile": "dynamod.daemon.profile.main",
}


def _available(mapping: dict[str, str]) -> dict[str, str]:
    """Only the roles whose module is part of this build are offered."""
    out = {}
    for name, module in mapping.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is not part of this build either
            found = False
        if found:
            out[name] = module
    return out


def _top_parser(roles: dict[str, str], subcommands: dict[str, str]) -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dynamod",
        description="dynamod: distributed LLM serving. Run one role per process, or `dynamod up` for a local cluster.",
        epilog="subcommands: " + ", ".join(sorted(subcommands)) + "  (see `dynamod SUBCOMMAND --help`)",
        add_help=False,
    )
    p.add_argument("--role", choices=sorted(roles), help="the role this process plays")
    p.add_argument("--version", action="version", version=f"dynamod {__version__}")
    p.add_argument("-h", "--help", action="store_true", help="show help (of the chosen role with --role)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    roles = _available(ROLES)
    subcommands = _available(SUBCOMMANDS)
    if argv and argv[0] in subcommands:
        name, module_name, rest = argv[0], subcommands[argv[0]], argv[1:]
        prog = f"dynamod {name}"
    else:
        top = _top_parser(roles, subcommands)
        known, rest = top.parse_known_args(argv)
        if known.role is None:
            if argv and not argv[0].startswith("-"):
                top.print_usage(sys.stderr)
                print(f"dynamod: error: unknown subcommand {argv[0]!r}; choose from {', '.join(sorted(subcommands))}", file=sys.stderr)
                return 2
            if rest and not known.help:  # `--rol agg`: say so, as the role parsers do (values not shown)
                top.error(unrecognized_message(rest))
            top.print_help()
            return 0 if known.help else 2
        if known.help:
            rest.append("--help")
        name, module_name = known.role, roles[known.role]
        prog = f"dynamod --role {name}"
    module = importlib.import_module(module_name)
    parser = ArgumentParser(prog=prog, description=(module.__doc__ or "").strip().split("\n\n")[0])
    module.add_args(parser)
    # A role may parse in two passes (the worker adds its chosen engine's flags first).
    args = module.parse_args(parser, rest) if hasattr(module, "parse_args") else parser.parse_args(rest)
    args.role = name
    configure_logging(getattr(args, "log_level", None))
    try:
        configure_tracing(getattr(args, "trace_sample_rate", None))
        if hasattr(module, "main_sync"):
            return int(module.main_sync(args) or 0)
        return run_role(lambda stop: module.run(args, stop), name=name)
    except DynamoError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
