"""The ``serving`` section of ``bench/disagg.py``: aggregated vs disaggregated at the same total
worker count, under a mixed load.

Each topology runs as real processes (a frontend in kv mode and mocker workers on file discovery
and ZMQ events, like ``dynamod up``). The load mixes two classes, as the issue asks:

- ``short``: many streams with short prompts and long outputs, kept at a fixed concurrency for the
  whole run (the running decodes whose inter-token latency disaggregation is meant to protect).
  ``--short-max-tokens LO,HI`` draws each request's output length (seeded per stream, the same
  draws in every topology): closed-loop streams of one length that start together finish
  together and arrive again together, in bursts that only a cluster whose steps jitter (an
  aggregated one, stalled by long prefills) breaks up;
- ``long``: long prompts (4-8k tokens by default) with short outputs, arriving at a fixed rate
  among them.

For each class it reports TTFT and ITL p50/p99 in wall milliseconds (the mocker runs at
``--serving-speedup``; multiply by it for model time), and for disaggregated topologies the
exposed KV transfer (the prefill's last block computed until the decode worker had every block;
mean, and p50/p99 interpolated from the decode workers' histogram buckets).
``--serving-kv-transfer-overlap`` sets ``--kv-transfer-overlap`` on the workers and the frontend. In an aggregated worker a long prompt's
prefill step is also the step of every decode running there, so those decodes' ITL jumps by the
prefill time; in a disaggregated cluster the decode workers only receive finished KV.

Each topology also reports the CPU seconds its processes used during the load, per role, and the
host's load averages before and after (``cpu_s``, ``loadavg``): the host may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_util import free_port, get_json, percentile, stop_processes
from frontend_load import Connection, HttpError, make_prompts, stream_request

CLI = [sys.executable, "-m", "dynamod.daemon.cli"]


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving")
    g.add_argument("--topologies", default="agg:4,disagg:1:3,disagg:1:3:cond,disagg:2:2",
                   help="agg:N and disagg:P:D[:cond] (cond: --router-conditional-disagg), comma-separated "
                   "[default agg:4,disagg:1:3,disagg:1:3:cond,disagg:2:2]")
    g.add_argument("--serving-duration", type=float, default=30.0, help="seconds of load per topology [default 30]")
    g.add_argument("--serving-speedup", type=float, default=1.0, help="mocker --speedup-ratio [default 1]")
    g.add_argument("--short-concurrency", type=int, default=24, help="short streams kept running [default 24]")
    g.add_argument("--short-prompt-tokens", type=int, default=100, help="[default 100]")
    g.add_argument("--short-max-tokens", default="200",
                   help="output tokens of each short stream: N, or LO,HI for a seeded uniform draw per request "
                   "(chat answers vary; streams of one length that start together stay in step) [default 200]")
    g.add_argument("--long-rate", type=float, default=4.0, help="long-prompt requests per second [default 4]")
    g.add_argument("--long-prompt-tokens", default="4096,8000", help="range of long prompts [default 4096,8000]")
    g.add_argument("--long-max-tokens", type=int, default=16, help="[default 16]")
    g.add_argument("--serving-worker-args", default="", help="extra flags for every worker")
    g.add_argument("--serving-frontend-args", default="", help="extra flags for the frontend")
    g.add_argument("--serving-kv-transfer-overlap", choices=("chunk", "none"), default=None,
                   help="--kv-transfer-overlap of disaggregated workers and the frontend [default: theirs]")


class Cluster:
    """One topology's processes; ``close()`` stops them."""

    def __init__(self, topology: str, args: argparse.Namespace) -> None:
        self.topology = topology
        self.root = Path(tempfile.mkdtemp(prefix="dynamod-bench-disagg-"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        self.env["DYN_FILE_KV"] = str(self.root / "kv")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.roles: list[str] = []  # each process's role (``frontend``, ``prefill``, ...), as procs
        self.names: list[str] = []  # each process's name (``decode-0``, ...; its log file's stem), as procs
        self.failed = False  # set when the cluster did not come up; its logs are then kept
        self.port = free_port()
        self.system_ports: dict[str, int] = {}  # worker name -> its status (metrics) port
        parts = topology.split(":")
        frontend_extra: list[str] = []
        if parts[0] == "agg" and len(parts) == 2:
            self.pools = {"agg": int(parts[1])}
        elif parts[0] == "disagg" and len(parts) in (3, 4) and parts[3:] in ([], ["cond"]):
            self.pools = {"prefill": int(parts[1]), "decode": int(parts[2])}
            if parts[3:] == ["cond"]:
                frontend_extra = ["--router-conditional-disagg"]
        else:
            raise SystemExit(f"bad topology {topology!r}: use agg:N or disagg:P:D[:cond]")
        runtime = ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", str(self.root / "kv")]
        worker_extra = args.serving_worker_args.split()
        overlap = getattr(args, "serving_kv_transfer_overlap", None)
        if overlap is not None and "prefill" in self.pools:
            worker_extra = [*worker_extra, "--kv-transfer-overlap", overlap]
            frontend_extra = [*frontend_extra, "--kv-transfer-overlap", overlap]
        for role, count in self.pools.items():
            for i in range(count):
                port = self.system_ports[f"{role}-{i}"] = free_port()
                self._spawn(role, f"{role}-{i}", [*CLI, "--role", role, "--engine", "mocker", "--model", "tiny", *runtime,
                                            "--speedup-ratio", str(args.serving_speedup), "--system-port", str(port),
                                            *worker_extra])
        self._spawn("frontend", "frontend", [*CLI, "--role", "frontend", *runtime, "--http-port", str(self.port),
                                             "--router-mode", "kv", *frontend_extra, *args.serving_frontend_args.split()])

    def _spawn(self, role: str, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        self.roles.append(role)
        self.names.append(name)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each role's processes have used so far, summed per role
        (Linux ``/proc``; empty elsewhere)."""
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        out: dict[str, float] = {}
        for role, proc in zip(self.roles, self.procs, strict=True):
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return out

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        want_decode = self.pools.get("agg", 0) + self.pools.get("decode", 0)
        want_prefill = self.pools.get("prefill", 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            body = get_json(self.url + "/health") or {}
            for m in body.get("models", []):
                ready = sum(1 for w in m.get("workers", []) if w.get("status") == "ready")
                if m.get("model") == "tiny" and ready >= want_decode and m.get("prefill_ready", 0) >= want_prefill:
                    return
            exited = [(name, proc.returncode) for name, proc in zip(self.names, self.procs, strict=True)
                      if proc.poll() is not None]
            if exited:
                self.failed = True
                name, code = exited[0]
                tail = (self.root / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise SystemExit(f"{self.topology}: {name} exited with {code} before the cluster was ready "
                                 f"(logs kept in {self.root}): " + " | ".join(tail))
            time.sleep(0.2)
        self.failed = True
        raise SystemExit(f"{self.topology}: cluster not ready after {timeout_s}s; logs kept in {self.root}")

    def close(self, keep_logs: bool = False) -> None:
        """Stops the processes; removes the log directory unless asked to keep it or the cluster
        failed to start (a failed start's logs are the only record of why)."""
        stop_processes(self.procs[::-1], 20)
        if keep_logs or self.failed:
            print(f"logs of {self.topology} kept in {self.root}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


class ClassStats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.done = 0
        self.errors = 0
        self.last_error = ""

    def summary(self) -> dict[str, Any]:
        ms = 1000.0
        return {
            "requests": self.done, "errors": self.errors,
            "ttft_ms_p50": round(percentile(self.ttft, 0.5) * ms, 2), "ttft_ms_p99": round(percentile(self.ttft, 0.99) * ms, 2),
            "itl_ms_p50": round(percentile(self.itl, 0.5) * ms, 2), "itl_ms_p99": round(percentile(self.itl, 0.99) * ms, 2),
            "itl_ms_p999": round(percentile(self.itl, 0.999) * ms, 2), "itl_ms_max": round(max(self.itl, default=0.0) * ms, 2),
            # Gaps longer than a long prompt's prefill would cause: decodes stalled behind one.
            "itl_over_50ms": sum(1 for x in self.itl if x > 0.05),
            **({"last_error": self.last_error} if self.last_error else {}),
        }


def short_output_range(spec: str) -> tuple[int, int]:
    """``--short-max-tokens``: ``N`` or ``LO,HI`` (inclusive) -> (lo, hi)."""
    try:
        parts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--short-max-tokens: expected N or LO,HI, got {spec!r}") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1]) if len(parts) == 2 else (0, -1)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--short-max-tokens: expected N or LO,HI with 1 <= LO <= HI, got {spec!r}")
    return lo, hi


def _body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()


async def _one(conn: Connection, body: bytes, stats: ClassStats) -> None:
    try:
        result = await stream_request(conn, "/v1/completions", body, keep_alive=True)
    except (HttpError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
        stats.errors += 1
        stats.last_error = str(exc)[:200]
        conn.close()
        return
    stats.done += 1
    stats.ttft.append(result.ttft)
    stats.itl.extend(result.itls)


async def run_load(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(seed)
    lo, hi = (int(x) for x in args.long_prompt_tokens.split(","))
    short_prompts = make_prompts(512, args.short_prompt_tokens, seed)
    short_lo, short_hi = short_output_range(args.short_max_tokens)
    long_lengths = sorted({rng.randint(lo, hi) // 256 * 256 for _ in range(16)})
    long_prompts = {n: make_prompts(64, n, seed + n) for n in long_lengths}
    short, long_ = ClassStats(), ClassStats()
    stop_at = time.monotonic() + args.serving_duration

    async def short_loop(i: int) -> None:
        conn = Connection(host, int(port))
        lengths = random.Random(seed * 1000 + i)  # per stream: the same draws in every topology
        k = i
        while time.monotonic() < stop_at:
            max_tokens = lengths.randint(short_lo, short_hi)
            await _one(conn, _body(short_prompts[k % len(short_prompts)], max_tokens), short)
            k += args.short_concurrency
        conn.close()

    async def long_arrivals() -> None:
        tasks = []
        k = 0
        # Let the short streams reach their steady state first.
        await asyncio.sleep(min(3.0, args.serving_duration / 5))
        while time.monotonic() < stop_at - 2.0:
            n = rng.choice(long_lengths)
            conn = Connection(host, int(port))
            tasks.append(asyncio.create_task(_one(conn, _body(long_prompts[n][k % 64], args.long_max_tokens), long_)))
            k += 1
            await asyncio.sleep(rng.expovariate(args.long_rate))
        await asyncio.gather(*tasks)

    await asyncio.gather(long_arrivals(), *(short_loop(i) for i in range(args.short_concurrency)))
    return {"short": short.summary(), "long": long_.summary()}


def _histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' ``histogram_quantile``: cumulative (upper bound, count) pairs, linear within a bucket."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower


def exposed_transfer(cluster: Cluster) -> dict[str, Any]:
    """The decode workers' exposed KV transfer (ms) from their
    ``dynamo_component_kv_transfer_exposed_seconds`` histograms, summed over workers."""
    name = "dynamo_component_kv_transfer_exposed_seconds"
    buckets: dict[float, float] = {}
    total = count = 0.0
    overlaps: set[str] = set()
    for worker, port in cluster.system_ports.items():
        if not worker.startswith("decode"):
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, value = line.rsplit(" ", 1)
            if 'overlap="' in head:
                overlaps.add(head.split('overlap="', 1)[1].split('"', 1)[0])
            if head.startswith(name + "_bucket"):
                le = head.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                buckets[bound] = buckets.get(bound, 0.0) + float(value)
            elif head.startswith(name + "_sum"):
                total += float(value)
            elif head.startswith(name + "_count"):
                count += float(value)
    ordered = sorted(buckets.items())
    return {
        "transfers": int(count), "overlap": sorted(overlaps),
        "ms_mean": round(total / count * 1000.0, 2) if count else 0.0,
        "ms_p50": round(_histogram_quantile(ordered, 0.5) * 1000.0, 2),
        "ms_p99": round(_histogram_quantile(ordered, 0.99) * 1000.0, 2),
    }


def _frontend_disagg_counts(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dynamo_frontend_disagg_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            mode = labels.split('mode="', 1)[1].split('"', 1)[0]
            out[mode] = out.get(mode, 0.0) + float(value)
    return out


async def serving_section(args: argparse.Namespace) -> dict[str, Any]:
    short_lo, short_hi = short_output_range(args.short_max_tokens)  # a bad value fails before any cluster starts
    out: dict[str, Any] = {
        "speedup": args.serving_speedup, "duration_s": args.serving_duration,
        "kv_transfer_overlap": args.serving_kv_transfer_overlap or "default",
        "short": {"concurrency": args.short_concurrency, "prompt_tokens": args.short_prompt_tokens,
                  "max_tokens": short_lo if short_lo == short_hi else [short_lo, short_hi]},
        "long": {"rate_per_s": args.long_rate, "prompt_tokens": args.long_prompt_tokens,
                 "max_tokens": args.long_max_tokens},
        "topologies": {},
    }
    for topology in args.topologies.split(","):
        cluster = Cluster(topology.strip(), args)
        try:
            await asyncio.to_thread(cluster.wait_ready)
            cpu_before, load_before = cluster.cpu_seconds(), os.getloadavg()
            result = await run_load(cluster.url, args, seed=1)
            cpu_after = cluster.cpu_seconds()
            # The host is shared: the load averages and each role's CPU during the load say how
            # much of the figures is contention.
            result["cpu_s"] = {role: round(cpu_after[role] - cpu_before.get(role, 0.0), 2) for role in cpu_after}
            result["loadavg"] = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
            decisions = _frontend_disagg_counts(cluster.url)
            if decisions:
                result["prefill_decisions"] = decisions
            if "prefill" in cluster.pools:
                result["exposed_transfer"] = exposed_transfer(cluster)
            out["topologies"][topology] = result
            print(f"serving {topology}: {json.dumps(result)}", file=sys.stderr, flush=True)
        finally:
            await asyncio.to_thread(cluster.close)
    return out
