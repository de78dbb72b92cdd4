"""The planner in the loop on the Mooncake synthetic trace: SLA attainment and worker-seconds of
the load and SLA planners against the best static allocation of the same budget. Prints JSON.

    python bench/planner.py [--trace PATH] [--max-requests N] [--budget GPUS] [--interval S]

Everything runs on the simulated clock (``dynamod replay --planner ... --compare-static``), agg
topology, default mocker, KV routing. "best_static" is the static agg fleet with the highest
attainment (ties: fewer worker-seconds); "cheapest_static_matching" the static fleet with the fewest
worker-seconds whose attainment is at least the planner's (null when none reaches it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

from dynamod.daemon.cli import main as dynamod_main

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parent.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def run_replay(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = dynamod_main(["replay", *argv, "--json"])
    if code:
        raise SystemExit(f"dynamod replay failed ({code}): {argv}")
    return json.loads(out.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=4, help="GPU budget (= most agg workers)")
    ap.add_argument("--interval", type=float, default=30.0, help="planner adjustment interval, s")
    ap.add_argument("--startup", type=float, default=30.0, help="worker startup delay, s")
    ap.add_argument("--ttft", type=float, default=2000.0)
    ap.add_argument("--itl", type=float, default=50.0)
    args = ap.parse_args()
    common = ["--trace", args.trace, "--max-requests", str(args.max_requests), "--max-gpu-budget", str(args.budget),
              "--ttft", str(args.ttft), "--itl", str(args.itl), "--startup-delay", str(args.startup),
              "--adjustment-interval", str(args.interval), "--workers", "1"]
    results: dict[str, object] = {"trace": Path(args.trace).name, "max_requests": args.max_requests,
                                  "gpu_budget": args.budget, "interval_s": args.interval, "startup_s": args.startup,
                                  "targets": {"ttft_ms": args.ttft, "itl_ms": args.itl}}
    static = None
    for name, extra in (("load", ["--planner", "load", "--optimization-target", "latency", "--context-length", "131072"]),
                        ("sla", ["--planner", "sla", "--load-predictor", "arima"])):
        started = time.perf_counter()
        res = run_replay(common + extra + ([] if static else ["--compare-static"]))
        static = static or res.get("static")
        results[name] = {
            "attainment_pct": res["sla"]["attainment_pct"],
            "ttft_ok_pct": res["sla"]["ttft_ok_pct"],
            "itl_ok_pct": res["sla"]["itl_ok_pct"],
            "worker_seconds": res["worker_seconds"],
            "peak_workers": res["planner"]["peak_workers"],
            "scale_ups": res["planner"]["scale_ups"],
            "scale_downs": res["planner"]["scale_downs"],
            "ttft_p50_ms": res["ttft_ms"]["p50"],
            "wall_s": round(time.perf_counter() - started, 1),
        }
    assert static is not None
    results["best_static"] = static["best"]
    results["static_runs"] = static["runs"]
    for name in ("load", "sla"):
        att = results[name]["attainment_pct"]  # type: ignore[index]
        match = [r for r in static["runs"] if r["attainment_pct"] >= att]
        results[f"cheapest_static_matching_{name}"] = min(match, key=lambda r: r["worker_seconds"]) if match else None
    json.dump(results, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
