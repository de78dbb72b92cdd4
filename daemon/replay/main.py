"""Replay a Mooncake-format trace through the real router and real mocker engines, simulated clock.

    dynamod replay --trace FILE.jsonl --workers 8 --router-mode kv --json
    dynamod replay --trace FILE.jsonl --prefill-workers 2 --decode-workers 6 --json

Each hash id is one block of ``--trace-block-size`` tokens; timestamps (ms) are divided by
``--arrival-speedup``. Mocker flags (``--num-gpu-blocks``, ``--block-size``, ...) and router flags
(``--kv-overlap-score-weight``, ``--router-temperature``, ...) take their usual defaults; in a
disaggregated replay both pools use them. ``--prefill-workers``/``--decode-workers`` replace
``--workers``; the transfer flags model moving the prompt's KV blocks between the pools, and
``--router-conditional-disagg`` prefills some requests locally (with ``prefill_load``, the busy
threshold counts prompt tokens queued on the chosen prefill worker).

With ``--planner load|sla`` the planner's policy runs in the loop on the simulated clock (every
``--adjustment-interval``; the policy flags are the planner daemon's): ``--workers`` (or
``--prefill-workers``/``--decode-workers``) is then the starting size, a scale-up counts a worker
only ``--startup-delay`` seconds after its launch, a scale-down drains. The summary adds SLA
attainment (% of requests within both ``--ttft`` and ``--itl``; ITL is each request's mean),
worker-seconds, and with ``--compare-static`` the best static allocation of the same budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dynamod.daemon.engines.mocker.config import MockerConfig, add_mocker_flags, config_from_args
from dynamod.daemon.planner.policy_args import add_policy_args, budget_from_args, build_policy
from dynamod.daemon.replay.planner_loop import (
    DEFAULT_STARTUP_S,
    ReplayPlanner,
    compare_static,
    static_allocations,
)
from dynamod.daemon.replay.simulator import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S,
    DEFAULT_KV_TRANSFER_LATENCY_MS,
    MODES,
    TransferModel,
    check_disagg_pools,
    replay,
    replay_disagg,
)
from dynamod.daemon.replay.trace import build_requests, load_trace
from dynamod.daemon.router.core.config import add_router_args
from dynamod.daemon.router.core.config import config_from_args as router_config_from_args
from dynamod.daemon.router.core.disagg_cost import DEFAULT_NUM_LAYERS, OVERLAP_CHUNK, OVERLAPS
from dynamod.daemon.router.core.disagg_policy import add_disagg_args, disagg_config_from_args
from dynamod.shared.errors import ConfigError, DynamoError

REPLAY_VOCAB = 32000  # Llama-sized vocabulary: room for the trace's block ids
DEFAULT_WORKERS = 8

_PROG = "dynamod replay"


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replay")
    g.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    g.add_argument("--workers", type=int, default=None,
                   help=f"aggregated mocker workers [default {DEFAULT_WORKERS}]; not with --prefill/--decode-workers")
    g.add_argument("--prefill-workers", type=int, default=None,
                   help="disaggregated replay: prefill workers (0: every request prefills on its decode worker)")
    g.add_argument("--decode-workers", type=int, default=None, help="disaggregated replay: decode workers")
    g.add_argument("--router-mode", choices=MODES, default="kv", help="routing policy of every pool [default kv]")
    g.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id [default 512]")
    g.add_argument("--arrival-speedup", type=float, default=1.0, help="divide arrival times by this [default 1]")
    g.add_argument("--max-requests", type=int, help="replay only the first N requests")
    g.add_argument("--seed", type=int, default=0, help="seed for random routing and tie-breaks [default 0]")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    t = parser.add_argument_group("KV transfer model (disaggregated replay)")
    t.add_argument("--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN,
                   help="KV cache bytes per token: layers x KV heads x head dim x 2 x dtype bytes "
                   f"[default {DEFAULT_KV_BYTES_PER_TOKEN}, Llama-3-8B in bf16]")
    t.add_argument("--kv-transfer-bandwidth", type=float, default=DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S,
                   help=f"prefill-to-decode bandwidth per transfer, GB/s (10^9 bytes) [default {DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S:g}]")
    t.add_argument("--kv-transfer-latency-ms", type=float, default=DEFAULT_KV_TRANSFER_LATENCY_MS,
                   help=f"fixed cost of each transfer, ms [default {DEFAULT_KV_TRANSFER_LATENCY_MS:g}]")
    t.add_argument("--kv-transfer-overlap", choices=OVERLAPS, default=OVERLAP_CHUNK,
                   help="chunk: each prefill chunk's blocks move to the decode worker as the chunk is computed, over "
                   "the decode worker's link in order; layer: the same, layer by layer within each chunk's step; "
                   "none: the whole transfer starts when the prefill ends, transfers independent [default chunk]")
    t.add_argument("--kv-num-layers", type=int, default=DEFAULT_NUM_LAYERS,
                   help=f"model layers, for --kv-transfer-overlap layer [default {DEFAULT_NUM_LAYERS}]")
    add_mocker_flags(parser.add_argument_group("mocker engine"))
    add_router_args(parser)
    add_disagg_args(parser)
    pl = parser.add_argument_group("planner in the loop")
    pl.add_argument("--startup-delay", type=float, default=DEFAULT_STARTUP_S, metavar="SECONDS",
                    help=f"launch to ready of a worker the planner adds (paid for meanwhile) [default {DEFAULT_STARTUP_S:g}]")
    pl.add_argument("--compare-static", action="store_true",
                    help="also replay every static allocation the budget allows and report the best one "
                    "(highest attainment) and the cheapest one at least as good as the planner")
    add_policy_args(parser)
    # A replay is static unless --planner is given: DYN_PLANNER in the environment (meant for the
    # planner daemon) must not turn a benchmark of a fixed fleet into a scaling one.
    for action in parser._actions:
        if action.dest == "planner":
            action.default = None
            action.help = "put this planner in the loop [default: none, a static fleet]"
        elif action.dest == "mode":
            action.help = "ignored by replay: agg with --workers, disagg with --prefill/--decode-workers"


def _topology(args: argparse.Namespace) -> tuple[int, int] | None:
    """``(prefill, decode)`` workers for a disaggregated replay, None for agg; ``ConfigError`` for
    a combination that cannot mean what the user wants."""
    p, d = args.prefill_workers, args.decode_workers
    if p is None and d is None:
        if args.router_conditional_disagg or args.router_conditional_disagg_config:
            raise ConfigError("--router-conditional-disagg needs --prefill-workers and --decode-workers")
        default = 1 if getattr(args, "planner", None) else DEFAULT_WORKERS
        workers = default if args.workers is None else args.workers
        if workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {workers}")
        return None
    if args.workers is not None:
        raise ConfigError("--workers is for aggregated replay; --prefill-workers and --decode-workers replace it")
    if p is None or d is None:
        raise ConfigError("a disaggregated replay needs both --prefill-workers and --decode-workers")
    check_disagg_pools(p, d, decode_fallback=args.decode_fallback)
    return p, d


def _planner(args: argparse.Namespace, topology: tuple[int, int] | None, mocker: MockerConfig) -> ReplayPlanner | None:
    if not getattr(args, "planner", None):
        return None
    args.mode = "disagg" if topology else "agg"
    budget = budget_from_args(args)
    if budget.decode_min < 1 or (topology and budget.prefill_min < 1):
        raise ConfigError("a replay needs at least one worker per pool: --min-endpoint >= 1")
    if args.startup_delay < 0:
        raise ConfigError(f"--startup-delay must be >= 0, got {args.startup_delay}")
    if getattr(args, "worker_startup_time", None) is None:
        args.worker_startup_time = args.startup_delay  # the policy's hysteresis follows the replay's start-up
    policy = build_policy(args)
    set_model = getattr(policy, "set_model", None)
    if set_model is not None:
        set_model(context_length=mocker.context_length, kv_block_size=mocker.block_size)
    return ReplayPlanner(policy, startup_s=args.startup_delay)


def main_sync(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        topology = _topology(args)
        mocker = config_from_args(args, vocab_size=REPLAY_VOCAB)
        router_config = router_config_from_args(args)
        policy = disagg_config_from_args(args) if topology else None
        transfer = TransferModel(args.kv_bytes_per_token, args.kv_transfer_bandwidth, args.kv_transfer_latency_ms,
                                 overlap=args.kv_transfer_overlap, num_layers=args.kv_num_layers)
        planner = _planner(args, topology, mocker)
    except ConfigError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    sla_targets = (float(args.ttft), float(args.itl))
    try:
        records = load_trace(args.trace)
        if args.max_requests:
            records = records[: args.max_requests]
        requests = build_requests(
            records, trace_block_size=args.trace_block_size, vocab_size=REPLAY_VOCAB, arrival_speedup=args.arrival_speedup
        )

        def run(prefill: int, decode: int, planner: ReplayPlanner | None) -> dict:
            if topology is None:
                return replay(requests, workers=decode, mode=args.router_mode, mocker=mocker,
                              router_config=router_config, seed=args.seed, planner=planner, sla_targets=sla_targets)
            return replay_disagg(requests, prefill_workers=prefill, decode_workers=decode, mode=args.router_mode,
                                 mocker=mocker, policy=policy, transfer=transfer, router_config=router_config,
                                 seed=args.seed, planner=planner, sla_targets=sla_targets)

        if topology is None:
            start = (0, args.workers or (1 if planner else DEFAULT_WORKERS))
        else:
            start = topology
        result = run(start[0], start[1], planner)
        if args.compare_static:
            comparison = compare_static(
                static_allocations(budget_from_args(args), topology is not None),
                lambda alloc: run(alloc.get("prefill", 0), alloc.get("decode", alloc.get("agg", 0)), None),
                float(result["sla"]["attainment_pct"]),
            )
            result["static"] = comparison.to_json()
    except DynamoError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
    result["arrival_speedup"] = args.arrival_speedup
    result["wall_s"] = round(time.perf_counter() - started, 3)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0
