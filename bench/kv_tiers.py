"""What host and disk KV tiers buy on a trace: hit rate and TTFT of a KV-routed fleet; prints JSON.

    python bench/kv_tiers.py [--trace FILE.jsonl] [--workers 8] [--speedups 1,4]
                             [--host-blocks 32768] [--disk-blocks 131072] [--max-requests N]

For each arrival speedup it replays the trace (as ``dynamod replay --router-mode kv`` does, in this
process) on ``--workers`` mockers with Dynamo's default settings, three ways: device cache only,
device + host tier, device + host + disk tier (``--num-host-blocks``/``--num-disk-blocks`` per
worker, default bandwidths). Each run reports the prefix hit rate (share of prompt tokens not
prefilled; with tiers, split by the tier that served them) and TTFT mean/p99.

The pooled reference is the hit rate of ONE cache holding the fleet's total blocks (device + host +
disk of every worker): the trace's requests in arrival order against one LRU of block hashes, a
request hitting its longest cached prefix (at most its prompt minus one token, as the engine).
It is an oracle for hit rate only: it has no compute, so it has no TTFT. A fleet whose tiers are
large enough, routed by KV overlap, should come close to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.replay.main import REPLAY_VOCAB
from dynamod.daemon.replay.simulator import replay
from dynamod.daemon.replay.trace import TraceRequest, build_requests, load_trace
from dynamod.shared.kv.hashing import hash_tokens

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def pooled_hit_rate(requests: list[TraceRequest], capacity_blocks: int, block_size: int) -> float:
    """Prompt tokens served by one shared LRU cache of ``capacity_blocks`` (hit rate oracle)."""
    lru: OrderedDict[int, None] = OrderedDict()
    prompt_total = hit_total = 0
    for req in sorted(requests, key=lambda r: r.arrival_ms):
        tokens = req.prompt
        hashes = hash_tokens(tokens, block_size)[1]
        max_blocks = (len(tokens) - 1) // block_size
        hits = 0
        for h in hashes[:max_blocks]:
            if h not in lru:
                break
            hits += 1
        prompt_total += len(tokens)
        hit_total += hits * block_size
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > capacity_blocks:
                    lru.popitem(last=False)
    return round(hit_total / prompt_total, 4) if prompt_total else 0.0


def figures(result: dict) -> dict:
    out = {
        "hit_rate": result["cache_hit_rate"],
        "ttft_ms_mean": result["ttft_ms"]["mean"],
        "ttft_ms_p99": result["ttft_ms"]["p99"],
    }
    tiers = result.get("kv_tiers")
    if tiers:
        out["hit_rate_by_tier"] = tiers["hit_rate"]
        out["onboarded_blocks"] = tiers["onboarded_blocks"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"Mooncake JSONL trace [default {DEFAULT_TRACE}]")
    ap.add_argument("--workers", type=int, default=8, help="mocker workers [default 8]")
    ap.add_argument("--speedups", default="1,4", help="comma-separated --arrival-speedup values [default 1,4]")
    ap.add_argument("--host-blocks", type=int, default=32768, help="host tier per worker, blocks [default 32768]")
    ap.add_argument("--disk-blocks", type=int, default=131072, help="disk tier per worker, blocks [default 131072]")
    ap.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    args = ap.parse_args(argv)

    base = MockerConfig(vocab_size=REPLAY_VOCAB)
    configs = {
        "gpu": base,
        "gpu+host": replace(base, num_host_blocks=args.host_blocks),
        "gpu+host+disk": replace(base, num_host_blocks=args.host_blocks, num_disk_blocks=args.disk_blocks),
    }
    records = load_trace(args.trace)
    if args.max_requests:
        records = records[: args.max_requests]
    doc: dict[str, object] = {
        "trace": str(args.trace), "requests": len(records), "workers": args.workers, "router_mode": "kv",
        "block_size": base.block_size, "gpu_blocks_per_worker": base.num_gpu_blocks,
        "host_blocks_per_worker": args.host_blocks, "disk_blocks_per_worker": args.disk_blocks,
        "runs": {},
    }
    for speedup in (float(s) for s in args.speedups.split(",")):
        requests = build_requests(records, trace_block_size=512, vocab_size=REPLAY_VOCAB, arrival_speedup=speedup)
        row: dict[str, object] = {}
        for name, config in configs.items():
            t0 = time.perf_counter()
            result = replay(requests, workers=args.workers, mode="kv", mocker=config, seed=0)
            row[name] = figures(result) | {"wall_s": round(time.perf_counter() - t0, 1)}
            print(f"# speedup {speedup:g} {name}: {row[name]}", file=sys.stderr, flush=True)
        fleet = args.workers * (base.num_gpu_blocks + args.host_blocks + args.disk_blocks)
        row["pooled_reference"] = {
            "hit_rate": pooled_hit_rate(requests, fleet, base.block_size), "capacity_blocks": fleet,
            "ttft_ms_mean": None, "ttft_ms_p99": None,
        }
        row["pooled_gpu_only_reference"] = {
            "hit_rate": pooled_hit_rate(requests, args.workers * base.num_gpu_blocks, base.block_size),
            "capacity_blocks": args.workers * base.num_gpu_blocks,
        }
        doc["runs"][f"{speedup:g}x"] = row  # type: ignore[index]
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
