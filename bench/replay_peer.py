"""The same trace through NVIDIA Dynamo 1.6.1's offline replay and ``dynamod replay``; prints one JSON document.

    python bench/replay_peer.py [--trace FILE.jsonl] [--dynamo-venv DIR] [--max-requests N]
                                [--topologies agg:8,disagg:3:5,disagg:2:6] [--transfer dynamo|dynamod|each]
                                [--kv-transfer-overlap chunk|layer|none]

Dynamo's replay (``dynamo.replay.run_trace_replay``: its Rust KV router and mocker on a simulated
clock) runs in its own virtualenv (``/work/shared/notes/dynamo-peer.md``; default
``/work/dynamo-peer/dynamo-venv``, or ``$DYNAMO_PEER_VENV``), one subprocess per topology.
``dynamod replay`` runs as the CLI, one subprocess per topology and policy: for each
disaggregated topology both always-remote (Dynamo's behaviour) and ``--router-conditional-disagg``.
Without the venv the script says so and exits 0 (it is a benchmark, not a test).

Per run: TTFT mean/p50/p99, ITL mean/p99, prefix-cache hit rate, wall time (the subprocess, so
interpreter start and trace loading count on both sides). Disaggregated runs add where the TTFT of a
remotely prefilled request goes: ``prefill_done_ms`` (arrival to the end of the prefill: routing,
the prefill queue and the compute) and ``after_prefill_ms`` (prefill end to first token: the KV
transfer, decode admission and the decode worker's first step). For Dynamo both come from its
per-request records; for dynamod from the replay's ``disagg`` section (``remote_prefill_ms``, and
TTFT minus it).

Settings, the same on both sides unless listed below: block size 64, 16384 KV blocks per worker,
max-num-seqs 256, max-num-batched-tokens 8192, prefix caching and chunked prefill on, speedup 1,
trace block size 512, arrival speedup 1, KV router with overlap weight 1 and temperature 0 in
every pool (Dynamo ``kv_router``, dynamod ``--router-mode kv``).

Settings that differ, and why:

- **KV transfer time.** Dynamo's replay charges none by default (``kv_transfer_bandwidth`` unset:
  the decode worker admits the request the instant the prefill ends; see ``source_held_ms ==
  decode_admit_ms`` in its per-request records). dynamod's default charges 1 ms plus the prompt
  blocks the decode worker lacks at 25 GB/s with Llama-3-8B's 128 KiB per token (a 5.7k-token
  prompt: 31 ms; 40k tokens: 211 ms), moved chunk by chunk as the prefill computes them, so only
  the part still moving when the prefill ends delays the first token (``--kv-transfer-overlap
  none`` in ``dynamod replay`` moves it all after the prefill). ``--transfer dynamo`` (the default) makes dynamod's transfer
  free too (``--kv-transfer-latency-ms 0``, an unbounded bandwidth) so that the two pipelines are
  compared, not the two transfer models. ``--transfer dynamod`` gives Dynamo dynamod's model
  instead, as far as it has one: ``kv_transfer_bandwidth`` 25 GB/s and
  ``kv_transfer_bytes_per_token`` 131072, but its ``full_prompt`` timing mode moves the whole prompt
  (dynamod moves only the blocks the decode worker lacks) and has no fixed latency. ``--transfer
  each`` leaves each side its own default, the comparison issue 23 quotes.
- **Tie-breaks.** Dynamo picks randomly among equal-cost workers even at temperature 0, unseeded,
  so its figures move a little from run to run (a few ms of mean TTFT on the shared trace);
  dynamod's are seeded (``--seed 0``) and repeat exactly.
- **Watermark.** dynamod's mocker keeps vLLM's 1 % free-block watermark when admitting; Dynamo's
  mocker has no such knob. With 16384 blocks per worker and these traces neither runs near it.
- **Conditional disaggregation** is dynamod's (``--router-conditional-disagg``, its default
  policy and thresholds); Dynamo's replay here always disaggregates, its default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import calibrate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
DEFAULT_VENV = Path(os.environ.get("DYNAMO_PEER_VENV", "/work/dynamo-peer/dynamo-venv"))

# Both mockers' engine defaults, spelled out so a change of either default cannot skew the match.
ENGINE = {"block_size": 64, "num_gpu_blocks": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
          "enable_prefix_caching": True, "enable_chunked_prefill": True, "speedup_ratio": 1.0}
TRACE_BLOCK = 512
# dynamod's default transfer model (daemon/replay/simulator.py), given to Dynamo by --transfer dynamod.
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
KV_BANDWIDTH_GB_S = 25.0
# --transfer dynamo: dynamod's transfer takes no time (the bandwidth must be finite).
FREE_BANDWIDTH_GB_S = 1e15

# Runs inside Dynamo's venv: argv[1] is a JSON job; prints one JSON object.
_DYNAMO_JOB = r"""
import json, sys, time
job = json.loads(sys.argv[1])
from dynamo.replay import run_trace_replay
t0 = time.perf_counter()
kw = dict(router_mode="kv_router", trace_block_size=job["trace_block_size"], arrival_speedup_ratio=1.0,
          capture_per_request=job["prefill"] > 0)
engine = dict(job["engine"])
if job["prefill"] == 0:
    rep = run_trace_replay([job["trace"]], extra_engine_args={"engine": engine}, num_workers=job["decode"], **kw)
else:
    rep = run_trace_replay([job["trace"]], prefill_engine_args={"engine": {**engine, "worker_type": "prefill"}},
                           decode_engine_args={"engine": {**engine, "worker_type": "decode"}},
                           num_prefill_workers=job["prefill"], num_decode_workers=job["decode"], **kw)
s = rep.summary
out = {"completed": s["completed_requests"],
       "ttft_ms": {"mean": s["mean_ttft_ms"], "p50": s["median_ttft_ms"], "p99": s["p99_ttft_ms"]},
       "itl_ms": {"mean": s["mean_itl_ms"], "p99": s["p99_itl_ms"]},
       "hit_rate": s["prefix_cache_reused_ratio"], "replay_wall_ms": s["wall_time_ms"]}
if rep.per_request:
    recs = rep.per_request
    def stat(xs):
        xs = sorted(xs)
        k = (len(xs) - 1) * 0.99
        lo = int(k); hi = min(lo + 1, len(xs) - 1)
        return {"mean": sum(xs) / len(xs), "p99": xs[lo] + (xs[hi] - xs[lo]) * (k - lo)}
    out["stages"] = {
        "prefill_done_ms": stat([r["source_held_ms"] - r["arrival_time_ms"] for r in recs]),
        "after_prefill_ms": stat([r["first_token_ms"] - r["source_held_ms"] for r in recs]),
        "transfer_ms": stat([r["decode_admit_ms"] - r["source_held_ms"] for r in recs]),
    }
out["wall_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def _round(doc: object) -> object:
    if isinstance(doc, float):
        return round(doc, 3)
    if isinstance(doc, dict):
        return {k: _round(v) for k, v in doc.items()}
    return doc


def run_dynamo(python: Path, trace: Path, prefill: int, decode: int, transfer: str, home: Path) -> dict:
    engine = dict(ENGINE)
    if transfer == "dynamod":
        engine.update(kv_transfer_bandwidth=KV_BANDWIDTH_GB_S, kv_transfer_bytes_per_token=KV_BYTES_PER_TOKEN)
    job = {"trace": str(trace), "prefill": prefill, "decode": decode, "engine": engine, "trace_block_size": TRACE_BLOCK}
    # Offline (no hub), quiet (its router logs every decision at INFO), caches under a scratch HOME.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(home), DYN_LOG="error")
    started = time.perf_counter()
    proc = subprocess.run([str(python), "-c", _DYNAMO_JOB, json.dumps(job)], capture_output=True, text=True, env=env,
                          timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"Dynamo replay failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - started
    return _round(out)  # type: ignore[return-value]


def run_dynamod(trace: Path, prefill: int, decode: int, conditional: bool, transfer: str, max_requests: int | None,
                overlap: str = "chunk") -> dict:
    cmd = [sys.executable, "-m", "dynamod.daemon.cli", "replay", "--trace", str(trace), "--json", "--router-mode", "kv",
           "--trace-block-size", str(TRACE_BLOCK), "--block-size", str(ENGINE["block_size"]),
           "--num-gpu-blocks", str(ENGINE["num_gpu_blocks"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
           "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]), "--speedup-ratio", "1", "--seed", "0"]
    if max_requests:
        cmd += ["--max-requests", str(max_requests)]
    if prefill == 0:
        cmd += ["--workers", str(decode)]
    else:
        cmd += ["--prefill-workers", str(prefill), "--decode-workers", str(decode), "--kv-transfer-overlap", overlap]
        if transfer == "dynamo":
            cmd += ["--kv-transfer-latency-ms", "0", "--kv-transfer-bandwidth", str(FREE_BANDWIDTH_GB_S)]
        if conditional:
            cmd.append("--router-conditional-disagg")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}  # flags only, no env fallbacks
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"dynamod replay failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    res = json.loads(proc.stdout)
    ttft, itl = res["ttft_ms"], res["itl_ms"]
    out: dict[str, object] = {
        "completed": res["completed"],
        "ttft_ms": {"mean": ttft["mean"], "p50": ttft["p50"], "p99": ttft["p99"]},
        "itl_ms": {"mean": itl["mean"], "p99": itl["p99"]},
        "hit_rate": res["cache_hit_rate"],
        "replay_wall_ms": round(res["wall_s"] * 1000.0, 1),
        "wall_s": round(wall, 3),
    }
    if prefill:
        dis = res["disagg"]
        out["remote"], out["local"], out["reasons"] = dis["remote"], dis["local"], dis["reasons"]
        if dis["remote"] and not dis["local"]:  # every request's TTFT splits at its prefill's end
            pre = dis["remote_prefill_ms"]
            out["stages"] = {"prefill_done_ms": {"mean": pre["mean"], "p99": pre["p99"]},
                             "after_prefill_ms": {"mean": round(ttft["mean"] - pre["mean"], 3)},
                             "transfer_ms": {"mean": dis["transfer_ms"]["mean"], "p99": dis["transfer_ms"]["p99"]}}
            if "exposed_transfer_ms" in dis:  # the part after the prefill ends (chunk-wise transfer overlaps the rest)
                exposed = dis["exposed_transfer_ms"]
                out["stages"]["exposed_transfer_ms"] = {"mean": exposed["mean"], "p99": exposed["p99"]}  # type: ignore[index]
    return out


def _topologies(spec: str) -> list[tuple[int, int]]:
    """``agg:8,disagg:3:5`` -> [(0, 8), (3, 5)]; ValueError on anything else."""
    out = []
    for part in filter(None, spec.split(",")):
        kind, *counts = part.split(":")
        if not all(c.isdigit() and int(c) >= 1 for c in counts):
            raise ValueError(part)
        if kind == "agg" and len(counts) == 1:
            out.append((0, int(counts[0])))
        elif kind == "disagg" and len(counts) == 2:
            out.append((int(counts[0]), int(counts[1])))
        else:
            raise ValueError(part)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"Mooncake JSONL trace [default {DEFAULT_TRACE}]")
    ap.add_argument("--dynamo-venv", type=Path, default=DEFAULT_VENV, help=f"Dynamo 1.6.1's virtualenv [default {DEFAULT_VENV}]")
    ap.add_argument("--topologies", default="agg:8,disagg:3:5,disagg:2:6",
                    help="comma-separated agg:N and disagg:P:D [default agg:8,disagg:3:5,disagg:2:6]")
    ap.add_argument("--transfer", choices=("dynamo", "dynamod", "each"), default="dynamo",
                    help="whose KV transfer model both sides use, or each its own [default dynamo: none]")
    ap.add_argument("--max-requests", type=int, help="only the first N requests of the trace")
    ap.add_argument("--kv-transfer-overlap", choices=("chunk", "layer", "none"), default="chunk",
                    help="dynamod's disaggregated KV transfer: with the prefill chunk by chunk or layer by layer, "
                    "or after it [default chunk]")
    args = ap.parse_args(argv)
    python = args.dynamo_venv / "bin" / "python"
    if not python.is_file():
        print(json.dumps({"skipped": f"no Dynamo venv at {args.dynamo_venv} (see shared/notes/dynamo-peer.md)"}))
        return 0
    try:
        topologies = _topologies(args.topologies)
    except ValueError as exc:
        print(f"bench/replay_peer.py: error: bad --topologies entry {exc}", file=sys.stderr)
        return 2
    if not args.trace.is_file():
        print(f"bench/replay_peer.py: error: no trace at {args.trace}", file=sys.stderr)
        return 2
    trace = args.trace.resolve()
    with tempfile.TemporaryDirectory(prefix="replay-peer-") as scratch:
        if args.max_requests:  # Dynamo's replay has no such option: cut the file instead
            cut = Path(scratch) / "trace.jsonl"
            lines = [ln for ln in trace.read_text().splitlines() if ln.strip()][: args.max_requests]
            cut.write_text("\n".join(lines) + "\n")
            trace = cut
        doc: dict[str, object] = {"trace": str(args.trace), "transfer": args.transfer,
                                  "kv_transfer_overlap": args.kv_transfer_overlap, "engine": ENGINE,
                                  "calibration_ns_per_dict_insert": {"before": calibrate()}, "runs": []}
        try:
            for prefill, decode in topologies:
                name = f"agg:{decode}" if prefill == 0 else f"disagg:{prefill}:{decode}"
                entry: dict[str, object] = {"topology": name,
                                            "dynamo": run_dynamo(python, trace, prefill, decode, args.transfer, Path(scratch))}
                if prefill == 0:
                    entry["dynamod"] = run_dynamod(trace, 0, decode, False, args.transfer, None)
                else:
                    entry["dynamod_always_remote"] = run_dynamod(trace, prefill, decode, False, args.transfer, None,
                                                                       args.kv_transfer_overlap)
                    entry["dynamod_conditional"] = run_dynamod(trace, prefill, decode, True, args.transfer, None,
                                                                     args.kv_transfer_overlap)
                doc["runs"].append(entry)  # type: ignore[union-attr]
                print(json.dumps(entry), file=sys.stderr)  # progress: a full run takes minutes
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"bench/replay_peer.py: error: {exc}", file=sys.stderr)
            return 1
    doc["calibration_ns_per_dict_insert"]["after"] = calibrate()  # type: ignore[index]
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
