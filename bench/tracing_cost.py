"""What request tracing costs the frontend: CPU per request at trace sample rates, against off.

    python bench/tracing_cost.py --rates off,0.01,1 --rounds 5 --requests 3000 --concurrency 16 \
        [--baseline-pythonpath /tmp/t30pkg] [--request-ids] --json

Each configuration is a single-host cluster (a frontend and one mocker worker with a high
``--speedup-ratio`` so that the frontend is the busy process; file discovery) with
``DYN_TRACE_SAMPLE_RATE`` set (a rate, or ``off``). In each round every configuration's cluster runs *at the same time*
under the same load (one ``frontend_load.py`` per cluster: streaming chat, reused connections), so
the CPU contention of a shared machine, which moves a frontend's CPU per request by ±15 % from one
minute to the next, falls on all of them alike; the report compares each configuration with the
reference *within* each round and gives the median of those ratios (and of the raw figures).

``off`` is this tree with tracing switched off (``DYN_TRACE_SAMPLE_RATE=off``: no root span, no
``traceparent``, nothing kept; the ``x-request-id`` echo stays), so it differs from the rates only
by tracing. Rate 0 is tracing on with nothing sampled (every request still gets a root span object
and a not-sampled ``traceparent``; errors and migrations are kept). ``--baseline-pythonpath`` adds
the configuration ``baseline``, run from another checkout (an import root whose ``dynamod``
package maps a tree without tracing; it also lacks whatever else changed since). The reference is
``off`` when it is among the rates, else ``baseline`` when given, else the first rate.
``--baseline-rates off,0.01,1`` runs the other tree at those rates as well (``baseline_off``, ...):
the same comparison before and after a change to tracing, in one run.

``--instructions`` counts instead of timing: each configuration's frontend runs under valgrind's
callgrind (instrumented only while the measured requests run: ``callgrind_control`` zeroes the
counters after a warm-up, by default 2100 requests so that the span ring is full and the measured
requests pay its evictions, and dumps them after the load), one configuration after the other, and
the report gives the frontend's instructions per successful request and, against the reference,
the C functions whose instructions per request changed most (``callgrind_annotate``: the
interpreter loop, the allocator, the garbage collector, msgspec, ...). Instruction counts do not
move with the other processes on a shared machine; what is left is the event loop batching
differently from run to run (an A/A pair, ``--rates off,off``, shows how much: up to 1 % a round).
About a minute per configuration and round.

    python bench/tracing_cost.py --instructions --rates off,0.01,1 --requests 400 --rounds 2 --json \
        [--baseline-pythonpath ROOT --baseline-rates off,0.01,1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import calibrate, free_port, get_json, stop_processes  # noqa: E402

CLI = [sys.executable, "-m", "dynamod.daemon.cli"]
LOAD = [sys.executable, str(Path(__file__).resolve().parent / "frontend_load.py")]


def start_cluster(
    root: Path, rate: str | None, pythonpath: str | None, workers: int, speedup: float, wrap: list[str] | None = None,
) -> tuple[list, str]:
    """A frontend and ``workers`` mocker workers on file discovery under ``root``; returns the
    processes (the frontend last) and the frontend's URL once it sees the workers ready. ``wrap``
    is put before the frontend's command line (valgrind)."""
    kv = root / "kv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "OTEL_"))}
    env["DYN_FILE_KV"] = str(kv)
    env["PYTHONHASHSEED"] = "0"  # the same dict and set layouts in every run: instruction counts repeat
    if rate is not None:
        env["DYN_TRACE_SAMPLE_RATE"] = rate
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    common = ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", str(kv)]
    port = free_port()
    procs = []
    for i in range(workers):
        log = open(root / f"worker{i}.log", "wb")  # noqa: SIM115 - the process owns it
        procs.append(subprocess.Popen(
            [*CLI, "--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", str(speedup), *common],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
        ))
    log = open(root / "frontend.log", "wb")  # noqa: SIM115
    procs.append(subprocess.Popen(
        [*(wrap or []), *CLI, "--role", "frontend", "--http-port", str(port), *common], env=env, stdout=log,
        stderr=subprocess.STDOUT, cwd=root,
    ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + (300 if wrap else 90)
    while time.monotonic() < deadline:
        health = get_json(url + "/health")
        if health and health.get("models") and health["models"][0].get("ready", 0) >= workers:
            return procs, url
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    stop_processes(procs, 5)
    tails = "\n".join(f"--- {log.name}\n" + log.read_text(errors="replace")[-1500:] for log in sorted(root.glob("*.log")))
    raise RuntimeError(f"cluster did not come up:\n{tails}")


def run_round(configs: list[tuple[str, str | None, str | None]], args: argparse.Namespace) -> dict[str, dict]:
    """Every configuration's cluster up, then all their loads at once; the figures per config."""
    with tempfile.TemporaryDirectory(prefix="tracecost-") as tmp:
        clusters: dict[str, tuple[list, str]] = {}
        try:
            for name, rate, path in configs:
                root = Path(tmp) / name
                root.mkdir()
                clusters[name] = start_cluster(root, rate, path, args.workers, args.speedup)
            loads = {}
            for name, (_, url) in clusters.items():
                argv = [*LOAD, "--url", url, "--requests", str(args.requests), "--warmup", str(args.warmup),
                        "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
                        "--prompt-tokens", str(args.prompt_tokens), "--nagle-probe-requests", "0", "--json"]
                if args.request_ids:
                    argv += ["--request-ids", "load"]
                loads[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out: dict[str, dict] = {}
            for name, proc in loads.items():
                stdout, stderr = proc.communicate()
                try:
                    run = json.loads(stdout)["runs"][0]
                except (ValueError, KeyError, IndexError):
                    raise RuntimeError(f"{name}: load failed: {stderr.decode(errors='replace')[-800:]}") from None
                # From the CPU seconds rather than the load's rounded per-request figure (3 decimals of
                # a ms is a 1 % step at ~0.4 ms/request).
                done = max(1, run["ok"])
                out[name] = {"cpu_ms_per_req": round(run["frontend_cpu_s"] * 1000 / done, 5), "req_per_s": run["req_per_s"],
                             "errors": run["errors"], "ttft_p50_ms": run["ttft_ms"]["p50"]}
            for name, rate, _ in configs:
                if rate not in (None, "off") and float(rate) > 0:  # the spans are really there: the frontend holds recent requests' roots
                    held = get_json(clusters[name][1] + "/v1/traces?slowest=1000") or {}
                    out[name]["traced_requests_held"] = len(held.get("requests", []))
            return out
        finally:
            for procs, _ in clusters.values():
                stop_processes(procs, 10)


# -- --instructions: callgrind ------------------------------------------------------------------------

_ANNOTATE_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*?)\s*$")


def load_once(url: str, args: argparse.Namespace, requests: int, seed: int) -> dict:
    argv = [*LOAD, "--url", url, "--requests", str(requests), "--warmup", "0", "--concurrency", str(args.concurrency),
            "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
            "--nagle-probe-requests", "0", "--seed", str(seed), "--json"]
    if args.request_ids:
        argv += ["--request-ids", "load"]
    done = subprocess.run(argv, capture_output=True, timeout=1800)
    try:
        return json.loads(done.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        raise RuntimeError(f"load failed: {done.stderr.decode(errors='replace')[-800:]}") from None


def callgrind_control(*argv: str) -> None:
    subprocess.run(["callgrind_control", *argv], check=True, capture_output=True, timeout=120)


def function_costs(dump: Path) -> tuple[int, dict[str, int]]:
    """The dump's total instructions and each function's own (exclusive) instructions."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(dump)], check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    total = 0
    funcs: dict[str, int] = {}
    for line in text.splitlines():
        m = _ANNOTATE_LINE.match(line)
        if m is None:
            continue
        count = int(m.group(1).replace(",", ""))
        what = m.group(2)
        if what.startswith("PROGRAM TOTALS"):
            total = count
        elif ":" in what and not what.startswith(("Ir", "--")):
            name = what.split(" [", 1)[0]
            funcs[name] = funcs.get(name, 0) + count
    return total, funcs


def instructions_once(name: str, rate: str | None, path: str | None, args: argparse.Namespace) -> dict:
    """One configuration's frontend under callgrind: its instructions over ``--requests`` requests."""
    with tempfile.TemporaryDirectory(prefix="tracecost-cg-") as tmp:
        root = Path(tmp) / name
        root.mkdir()
        out_file = root / "callgrind.out"
        wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}"]
        procs, url = start_cluster(root, rate, path, args.workers, args.speedup, wrap)
        frontend = procs[-1]
        try:
            # Not instrumented: code paths warm, and the span ring full (its default 2000 requests),
            # so that the measured requests pay its evictions as a long-running frontend does.
            load_once(url, args, args.instructions_warmup, seed=1)
            callgrind_control("-i", "on", str(frontend.pid))
            load_once(url, args, max(16, args.warmup), seed=2)  # instrumented, then forgotten
            callgrind_control("-z", str(frontend.pid))
            run = load_once(url, args, args.requests, seed=3)
            callgrind_control("-d", str(frontend.pid))
            callgrind_control("-i", "off", str(frontend.pid))
            dumps = sorted(root.glob("callgrind.out*"), key=lambda f: f.stat().st_mtime)
            if not dumps:
                raise RuntimeError(f"{name}: callgrind wrote no dump")
            total, funcs = function_costs(dumps[-1])
            ok = max(1, run["ok"])
            return {"instructions_per_req": round(total / ok), "ok": run["ok"], "errors": run["errors"],
                    "functions": {k: v / ok for k, v in funcs.items()}}
        finally:
            stop_processes(procs, 20)


def instructions_report(configs: list[tuple[str, str | None, str | None]], ref: str, args: argparse.Namespace) -> dict:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("tracing_cost: --instructions needs valgrind (callgrind_control, callgrind_annotate)")
    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):
        rounds.append({name: instructions_once(name, rate, path, args) for name, rate, path in configs})
    summary: dict[str, dict] = {}
    for name, _, _ in configs:
        per_req = [r[name]["instructions_per_req"] for r in rounds]
        entry: dict = {"instructions_per_req": per_req, "instructions_per_req_median": round(statistics.median(per_req))}
        if name != ref:
            ratios = [r[name]["instructions_per_req"] / r[ref]["instructions_per_req"] - 1 for r in rounds]
            entry[f"change_vs_{ref}_pct_per_round"] = [round(100 * x, 2) for x in ratios]
            entry[f"change_vs_{ref}_pct_median"] = round(100 * statistics.median(ratios), 2)
            # per function: the mean over rounds of (this config - reference), instructions per request
            names = {f for r in rounds for f in (*r[name]["functions"], *r[ref]["functions"])}
            diff = {f: statistics.fmean(r[name]["functions"].get(f, 0) - r[ref]["functions"].get(f, 0) for r in rounds)
                    for f in names}
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top_functions]
            entry[f"functions_vs_{ref}_instructions_per_req"] = {f: round(v) for f, v in top}
        summary[name] = entry
    return {
        "mode": "instructions", "requests": args.requests, "warmup_requests": args.instructions_warmup,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "reference": ref,
        "configs": summary, "errors": sum(r[name]["errors"] for r in rounds for name in r),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="off,0.01,1", help="comma-separated trace sample rates (a number or 'off')")
    p.add_argument("--baseline-pythonpath", default="", help="import root of a tree without tracing (adds 'baseline')")
    p.add_argument("--baseline-rates", default="",
                   help="with --baseline-pythonpath: run that tree at these rates too (baseline_off, baseline_rate_R: "
                        "a before/after comparison of a change to tracing)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--speedup", type=float, default=50.0)
    p.add_argument("--request-ids", action="store_true", help="send a client x-request-id with every request")
    p.add_argument("--instructions", action="store_true",
                   help="count the frontend's instructions per request under callgrind instead of CPU time")
    p.add_argument("--top-functions", type=int, default=15, help="--instructions: functions listed per config")
    p.add_argument("--instructions-warmup", type=int, default=2100,
                   help="--instructions: requests sent before counting (default: enough to fill the span ring)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    configs: list[tuple[str, str | None, str | None]] = []
    if args.baseline_pythonpath and not args.baseline_rates:
        configs.append(("baseline", None, args.baseline_pythonpath))
    elif args.baseline_rates:
        if not args.baseline_pythonpath:
            p.error("--baseline-rates needs --baseline-pythonpath")
        for text in args.baseline_rates.split(","):
            text = text.strip().lower()
            configs.append(("baseline_off" if text == "off" else f"baseline_rate_{text}", text, args.baseline_pythonpath))
    for text in args.rates.split(","):
        text = text.strip().lower()
        if text != "off":
            try:
                ok = 0.0 <= float(text) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                p.error(f"--rates: {text!r} is not a rate from 0 to 1 or 'off'")
        name = "off" if text == "off" else f"rate_{text}"
        taken = {n for n, _, _ in configs}
        if name in taken:  # the same rate twice (an A/A run: how far apart two like clusters land)
            name = next(f"{name}_{k}" for k in range(2, 100) if f"{name}_{k}" not in taken)
        configs.append((name, text, None))
    names = [name for name, _, _ in configs]
    ref = "off" if "off" in names else names[0]
    if args.instructions:
        report = instructions_report(configs, ref, args)
        print(json.dumps(report) if args.json else json.dumps(report, indent=2))
        return 0 if report["errors"] == 0 else 1
    calibration = calibrate()
    loadavg = os.getloadavg()
    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):
        for attempt in range(3):  # a start that failed on a busy shared machine is tried again
            try:
                rounds.append(run_round(configs, args))
                break
            except RuntimeError as exc:
                if attempt == 2:
                    raise
                print(f"tracing_cost: {exc}; retrying the round", file=sys.stderr)
    summary: dict[str, dict] = {}
    for name, _, _ in configs:
        cpu = [r[name]["cpu_ms_per_req"] for r in rounds]
        entry: dict = {"cpu_ms_per_req": cpu, "cpu_ms_per_req_median": round(statistics.median(cpu), 4),
                       "req_per_s": [r[name]["req_per_s"] for r in rounds]}
        if name != ref:
            ratios = [r[name]["cpu_ms_per_req"] / r[ref]["cpu_ms_per_req"] - 1 for r in rounds]
            entry[f"change_vs_{ref}_pct_per_round"] = [round(100 * x, 1) for x in ratios]
            entry[f"change_vs_{ref}_pct_median"] = round(100 * statistics.median(ratios), 1)
        held = [r[name]["traced_requests_held"] for r in rounds if "traced_requests_held" in r[name]]
        if held:
            entry["traced_requests_held"] = held
        summary[name] = entry
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "reference": ref,
        "calibration_ns_per_dict_insert": {"before": calibration, "after": calibrate()},
        "loadavg_before": loadavg, "loadavg_after": os.getloadavg(), "configs": summary,
        "errors": sum(r[name]["errors"] for r in rounds for name in r),
    }
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
