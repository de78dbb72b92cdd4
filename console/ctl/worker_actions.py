"""dynamoctl's worker actions: each subcommand's arguments next to the control body it builds.

    dynamoctl drain|sleep|wake|clear-kv INSTANCE
    dynamoctl lora load|unload|list ...

Every parser carries its ``ActionSpec`` (``console/actions/specs.py``) and a function from the
parsed arguments to the spec's body (``shared/protocol/control.py``), so running any of them is the
one call ``ControlClient.run(spec, instance, body)`` (``commands.action``) with no branch per verb.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from dynamod.console.actions.specs import ACTIONS_BY_VERB
from dynamod.shared.protocol import control
from dynamod.shared.protocol.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU

BodyOf = Callable[[argparse.Namespace], control.ControlBody]

# The operator's tier names -> the KV events' media (shared/protocol/kv_events.py).
TIER_MEDIUM = {"gpu": MEDIUM_GPU, "host": MEDIUM_CPU, "disk": MEDIUM_DISK}


def _clear_kv_body(args: argparse.Namespace) -> control.ClearKvRequest:
    return control.ClearKvRequest(medium=TIER_MEDIUM[args.tier]) if args.tier else control.ClearKvRequest()


def _action_parser(sub: Any, conn: argparse.ArgumentParser, name: str, verb: str, text: str, body_of: BodyOf) -> argparse.ArgumentParser:
    """A subcommand ``name`` running the action whose dynamoctl verb is ``verb``."""
    p = sub.add_parser(name, parents=[conn], help=text)
    p.set_defaults(action_spec=ACTIONS_BY_VERB[verb], body_of=body_of)
    return p


def add_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds drain, sleep, wake and clear-kv to dynamoctl's subcommands (``conn``: connection flags)."""
    d = _action_parser(sub, conn, "drain", "drain", "stop sending new requests to a worker",
                       lambda a: control.DrainRequest(wait=a.wait, timeout_s=a.drain_timeout))
    d.add_argument("instance")
    d.add_argument("--wait", action="store_true", help="return only once in-flight requests finished")
    d.add_argument("--drain-timeout", type=float, default=300.0, help="with --wait: give up after this many seconds")
    d.add_argument("--json", action="store_true")
    sl = _action_parser(sub, conn, "sleep", "sleep", "put a worker to sleep (release engine memory)",
                        lambda a: control.SleepRequest(level=a.level))
    sl.add_argument("instance")
    sl.add_argument("--level", type=int, default=1, choices=(1, 2), help="1 keeps weights on host, 2 drops them [default 1]")
    sl.add_argument("--json", action="store_true")
    w = _action_parser(sub, conn, "wake", "wake", "wake a sleeping or drained worker", lambda a: control.EmptyRequest())
    w.add_argument("instance")
    w.add_argument("--json", action="store_true")
    c = _action_parser(sub, conn, "clear-kv", "clear-kv", "drop a worker's cached KV blocks", _clear_kv_body)
    c.add_argument("instance")
    c.add_argument("--json", action="store_true")
    c.add_argument("--tier", choices=tuple(TIER_MEDIUM), default=None,
                   help="clear only this KV tier: gpu (device), host (CPU memory), disk [default: every tier]")


def add_lora_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Adds ``lora load|unload|list``."""
    lora = sub.add_parser("lora", help="LoRA adapters: load, unload, list")
    lsub = lora.add_subparsers(dest="lora_command", metavar="load|unload|list")
    ll = _action_parser(lsub, conn, "load", "lora load", "load an adapter on a worker",
                        lambda a: control.LoadLoraRequest(lora_name=a.name, source=control.LoraSource(uri=a.source)))
    ll.add_argument("instance")
    ll.add_argument("name")
    ll.add_argument("source", help="path or URI of the adapter (file://, s3://, hf://, or a directory)")
    ll.add_argument("--json", action="store_true")
    lu = _action_parser(lsub, conn, "unload", "lora unload", "unload an adapter from a worker",
                        lambda a: control.UnloadLoraRequest(lora_name=a.name))
    lu.add_argument("instance")
    lu.add_argument("name")
    lu.add_argument("--json", action="store_true")
    ls = _action_parser(lsub, conn, "list", "lora list", "adapters loaded on one worker, or on all",
                        lambda a: control.EmptyRequest())
    ls.add_argument("instance", nargs="?")
    ls.add_argument("--json", action="store_true")
