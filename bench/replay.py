"""Trace replay speed: how long ``dynamod replay`` takes on a Mooncake trace; prints one JSON document.

    python bench/replay.py [--trace FILE.jsonl] [--tile N] [--workers 8] [--modes kv,round-robin]
                           [--disagg P:D ...] [--no-agg] [--repeat 2] [--check]

Each run loads the trace, builds the requests and replays them (as the ``dynamod replay`` command
does, without starting a process), with Dynamo's default mocker and router settings. Per routing
mode it reports every run's wall time and CPU time (this process's), the best of each, and the
replay's figures (identical on every run: the replay is deterministic). ``--check`` also replays
once step by step (``fast_forward=False``, every engine step its own event: the reference) and
says whether the figures are the same to the last digit, with that run's times. ``--disagg 3:5``
adds a disaggregated replay (3 prefill, 5 decode workers; always remote, dynamod's default transfer
model) per mode; ``--no-agg`` leaves the aggregated one out.

The default trace is the Mooncake synthetic trace beside the repository (``shared/data``, 3,993
requests); ``--trace`` takes another, such as Mooncake's 12,031-request conversation trace
(``FAST25-release/traces/conversation_trace.jsonl``). ``--tile N`` replays N copies of the trace
one after another (ids shifted so the copies share no prefix), to make a longer one from it.

Wall time on a shared machine includes time other processes held the cores; the CPU times do not,
and ``calibration_ns_per_dict_insert`` (``bench_util.calibrate``, before and after) tells how
fast the machine ran Python meanwhile, to compare runs and machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.replay.main import REPLAY_VOCAB
from dynamod.daemon.replay.simulator import MODES, TransferModel, replay, replay_disagg
from dynamod.daemon.replay.trace import TraceRecord, build_requests, load_trace
from dynamod.daemon.router.core.disagg_cost import OVERLAP_CHUNK, OVERLAPS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import calibrate  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def tiled(records: list[TraceRecord], copies: int) -> list[TraceRecord]:
    """``copies`` runs of the trace back to back; each copy's hash ids are shifted past the last."""
    if copies <= 1:
        return records
    span = max(r.timestamp for r in records) + 1000.0
    shift = max(h for r in records for h in r.hash_ids) + 1
    out = []
    for c in range(copies):
        out += [TraceRecord(r.timestamp + c * span, r.input_length, r.output_length, [h + c * shift for h in r.hash_ids])
                for r in records]
    return out


def one_run(path: Path, copies: int, topology: tuple[int, int], mode: str, seed: int,
            fast_forward: bool, overlap: str = "chunk") -> tuple[dict, float, float]:
    """(figures, wall seconds, CPU seconds) of loading, building and replaying the trace;
    ``topology`` is (0, workers) for agg, (prefill, decode) workers for disagg; ``overlap`` the
    disaggregated KV transfer's (``dynamod replay --kv-transfer-overlap``)."""
    w0, c0 = time.perf_counter(), time.process_time()
    records = tiled(load_trace(path), copies)
    requests = build_requests(records, trace_block_size=512, vocab_size=REPLAY_VOCAB)
    mocker = MockerConfig(vocab_size=REPLAY_VOCAB)
    prefill, decode = topology
    if prefill:
        figures = replay_disagg(requests, prefill_workers=prefill, decode_workers=decode, mode=mode, mocker=mocker,
                                transfer=TransferModel(overlap=overlap), seed=seed,
                                sla_targets=(500.0, 50.0), fast_forward=fast_forward)
    else:
        figures = replay(requests, workers=decode, mode=mode, mocker=mocker, seed=seed, sla_targets=(500.0, 50.0),
                         fast_forward=fast_forward)
    return figures, round(time.perf_counter() - w0, 3), round(time.process_time() - c0, 3)


def _split(text: str) -> tuple[int, int]:
    """``P:D`` -> (P, D), both at least 1."""
    p, _, d = text.partition(":")
    if not (p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"expected PREFILL:DECODE workers, got {text!r}")
    return int(p), int(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"Mooncake JSONL trace [default {DEFAULT_TRACE}]")
    ap.add_argument("--tile", type=int, default=1, help="replay this many copies of the trace back to back [default 1]")
    ap.add_argument("--workers", type=int, default=8, help="aggregated mocker workers [default 8]")
    ap.add_argument("--modes", default="kv,round-robin", help=f"comma-separated, of {', '.join(MODES)} [default kv,round-robin]")
    ap.add_argument("--disagg", type=_split, action="append", default=[], metavar="P:D",
                    help="also replay disaggregated on P prefill and D decode workers (repeatable)")
    ap.add_argument("--no-agg", action="store_true", help="skip the aggregated replay")
    ap.add_argument("--kv-transfer-overlap", choices=OVERLAPS, default=OVERLAP_CHUNK,
                    help="disaggregated replays' KV transfer: chunk by chunk or layer by layer with the prefill, "
                    "or after it (none) [default chunk]")
    ap.add_argument("--repeat", type=int, default=2, help="runs per mode [default 2]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="also replay step by step once per mode and compare")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or args.repeat < 1 or args.workers < 1 or args.tile < 1:
        print(f"bench/replay.py: error: bad --modes {bad}, --repeat, --workers or --tile", file=sys.stderr)
        return 2
    if not args.trace.is_file():
        print(f"bench/replay.py: error: no trace at {args.trace}", file=sys.stderr)
        return 2
    before = calibrate()
    records = tiled(load_trace(args.trace), args.tile)
    doc: dict[str, object] = {
        "trace": str(args.trace),
        "tile": args.tile,
        "requests": len(records),
        "output_tokens": sum(r.output_length for r in records),
        "workers": args.workers,
        "runs": [],
    }
    topologies = ([] if args.no_agg else [(0, args.workers)]) + args.disagg
    for mode in modes:
        for topology in topologies:
            walls, cpus, figures = [], [], None
            for _ in range(args.repeat):
                res, wall, cpu = one_run(args.trace, args.tile, topology, mode, args.seed, True, args.kv_transfer_overlap)
                assert figures is None or res == figures, "the replay is not deterministic"
                figures = res
                walls.append(wall)
                cpus.append(cpu)
            name = f"disagg:{topology[0]}:{topology[1]}" if topology[0] else f"agg:{topology[1]}"
            entry: dict[str, object] = {"mode": mode, "topology": name, "wall_s": walls, "cpu_s": cpus,
                                        "best_wall_s": min(walls), "best_cpu_s": min(cpus), "figures": figures}
            if args.check:
                ref, wall, cpu = one_run(args.trace, args.tile, topology, mode, args.seed, False, args.kv_transfer_overlap)
                entry["step_by_step"] = {"identical": ref == figures, "wall_s": wall, "cpu_s": cpu}
            doc["runs"].append(entry)  # type: ignore[union-attr]
    doc["calibration_ns_per_dict_insert"] = {"before": before, "after": calibrate()}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
