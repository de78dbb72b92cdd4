"""Measure an engine and write the performance profile the SLA planner interpolates.

    dynamod profile --output profile.json                    the mocker, in-process, simulated clock
    dynamod profile --endpoint dynamo.backend.generate ...   a running worker, over the request plane

In-process (the default) builds a mocker from the mocker flags and steps its timing model without
sleeping: deterministic, seconds, no cluster; the profile shipped in the package
(``daemon/assets/profiles/mocker.json``) is this with default flags. ``--endpoint`` sends real
requests to one instance of a live worker (any engine) found through discovery (the runtime flags)
and times them on the wall clock: minutes, and the worker should be otherwise idle.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from dynamod.daemon.engines.mocker.config import add_mocker_flags, config_from_args
from dynamod.daemon.perf.profile import PerfProfile
from dynamod.daemon.profile.sweep import (
    DEFAULT_CONCURRENCIES,
    DEFAULT_CONTEXTS,
    DEFAULT_DECODE_OSL,
    DEFAULT_ISLS,
    SweepPlan,
    sweep_mocker,
)
from dynamod.shared.config import add_runtime_args, env_or, settings_from_args
from dynamod.shared.errors import ConfigError, DynamoError

PROFILE_VOCAB = 32000
_PROG = "dynamod profile"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected increasing positive integers, got {text!r}")
    return values


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profile")
    g.add_argument("--output", "-o", default="profile.json", help="where to write the profile JSON [default profile.json]")
    g.add_argument("--endpoint", metavar="NS.COMPONENT.ENDPOINT",
                   help="profile a live worker's generate endpoint over the request plane (real engines; wall "
                   "clock, minutes) instead of an in-process mocker on a simulated clock (seconds)")
    g.add_argument("--isl", type=_ints, default=DEFAULT_ISLS, metavar="N,N,...",
                   help=f"prefill input lengths [default {_csv(DEFAULT_ISLS)}; capped at the context length]")
    g.add_argument("--context", type=_ints, default=DEFAULT_CONTEXTS, metavar="N,N,...",
                   help=f"decode context lengths [default {_csv(DEFAULT_CONTEXTS)}]")
    g.add_argument("--concurrency", type=_ints, default=DEFAULT_CONCURRENCIES, metavar="N,N,...",
                   help=f"decode batch sizes, capped by max_num_seqs and the KV cache [default {_csv(DEFAULT_CONCURRENCIES)}]")
    g.add_argument("--decode-osl", type=int, default=DEFAULT_DECODE_OSL,
                   help=f"tokens decoded per decode point [default {DEFAULT_DECODE_OSL}]")
    g.add_argument("--engine-num-gpu", type=int, default=1, help="GPUs the profiled engine uses [default 1]")
    live = parser.add_argument_group("live worker (--endpoint)")
    live.add_argument("--model", default=env_or("DYN_MODEL", ""), help="model name sent in the requests [env DYN_MODEL]")
    live.add_argument("--max-kv-tokens", type=int, help="KV capacity of the engine in tokens [default: its model card]")
    live.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take [default 600]")
    live.add_argument("--wait", type=float, default=30.0, help="seconds to wait for a ready instance [default 30]")
    live.add_argument("--vocab-size", type=int, default=PROFILE_VOCAB,
                      help=f"token ids of the synthetic prompts stay below this [default {PROFILE_VOCAB}]")
    add_runtime_args(parser)
    add_mocker_flags(parser.add_argument_group("mocker engine (in-process sweep)"))


def main_sync(args: argparse.Namespace) -> int:
    plan = SweepPlan(isls=args.isl, contexts=args.context, concurrencies=args.concurrency,
                     decode_osl=args.decode_osl, engine_num_gpu=args.engine_num_gpu)
    try:
        if args.decode_osl < 1 or args.engine_num_gpu < 1:
            raise ConfigError("--decode-osl and --engine-num-gpu must be >= 1")
        if args.endpoint:
            from dynamod.daemon.profile.endpoint import EndpointTarget, sweep_endpoint

            profile: PerfProfile = asyncio.run(sweep_endpoint(
                settings_from_args(args), EndpointTarget.parse(args.endpoint), plan, model=args.model,
                max_kv_tokens=args.max_kv_tokens, vocab=args.vocab_size, timeout_s=args.request_timeout,
                wait_s=args.wait))
        else:
            profile = sweep_mocker(config_from_args(args, vocab_size=PROFILE_VOCAB), plan)
        profile.save(Path(args.output))
    except DynamoError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
    rows = profile.decode.rows
    print(f"wrote {args.output}: prefill {len(profile.prefill.isl)} points, decode {len(rows)} context lengths "
          f"x {sum(len(r.kv_usage) for r in rows)} points")
    return 0
