"""Replay a Mooncake-format trace through the real router and real mocker engines, simulated clock.

    dynamod replay --trace FILE.jsonl --workers 8 --router-mode kv --json

Each hash id is one block of ``--trace-block-size`` tokens; timestamps (ms) are divided by
``--arrival-speedup``. Mocker flags (``--num-gpu-blocks``, ``--block-size``, ...) and router flags
(``--kv-overlap-score-weight``, ``--router-temperature``, ...) take their usual defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dynamod.daemon.engines.mocker.config import add_mocker_flags, config_from_args
from dynamod.daemon.replay.simulator import MODES, replay
from dynamod.daemon.replay.trace import build_requests, load_trace
from dynamod.daemon.router.config import add_router_args
from dynamod.daemon.router.config import config_from_args as router_config_from_args
from dynamod.shared.errors import DynamoError

REPLAY_VOCAB = 32000  # Llama-sized vocabulary: room for the trace's block ids


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replay")
    g.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    g.add_argument("--workers", type=int, default=8, help="mocker workers [default 8]")
    g.add_argument("--router-mode", choices=MODES, default="kv", help="routing policy [default kv]")
    g.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id [default 512]")
    g.add_argument("--arrival-speedup", type=float, default=1.0, help="divide arrival times by this [default 1]")
    g.add_argument("--max-requests", type=int, help="replay only the first N requests")
    g.add_argument("--seed", type=int, default=0, help="seed for random routing and tie-breaks [default 0]")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_mocker_flags(parser.add_argument_group("mocker engine"))
    add_router_args(parser)


def main_sync(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("dynamod replay: error: --workers must be at least 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        records = load_trace(args.trace)
        if args.max_requests:
            records = records[: args.max_requests]
        mocker = config_from_args(args, vocab_size=REPLAY_VOCAB)
        requests = build_requests(
            records, trace_block_size=args.trace_block_size, vocab_size=REPLAY_VOCAB, arrival_speedup=args.arrival_speedup
        )
        result = replay(
            requests, workers=args.workers, mode=args.router_mode, mocker=mocker,
            router_config=router_config_from_args(args), seed=args.seed,
        )
    except DynamoError as exc:
        print(f"dynamod replay: error: {exc}", file=sys.stderr)
        return 1
    result["arrival_speedup"] = args.arrival_speedup
    result["wall_s"] = round(time.perf_counter() - started, 3)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0
