"""Soak: a `dynamod up` cluster under steady mixed load, with a worker restarted every N seconds.

    python bench/soak.py [--duration 600] [--workers 3] [--restart-every 30] [--concurrency 8]

Starts ``dynamod up`` (real processes: the supervisor, a frontend, ``--workers`` mocker workers,
file discovery and logs in a temporary directory), drives streaming chat completions of two kinds
(short prompts and answers, long prompts and answers) at fixed concurrency, and sends SIGTERM to one
worker (the restart target) every ``--restart-every`` seconds: the supervisor restarts it. Every
``--sample-every`` seconds it reads, for each process of the cluster, VmRSS and thread count from
``/proc/PID/status``, the open descriptors from ``/proc/PID/fd``, and the asyncio tasks alive on its
event loop from its ``/metrics`` (``dynamo_process_asyncio_tasks``; the supervisor exports none).

Prints JSON: per process, RSS and fd growth from the end of the first window (warm) to the end
(the restarted worker's figures are its last incarnation's, and its restarts are counted); errors
(failed streams, streams that ended without ``[DONE]``) and short streams (fewer tokens than asked:
every request sets ``ignore_eos``, so a short stream is a truncated one);
TTFT and ITL p50/p99 of the first ``--window`` seconds against the last; and whether the targets
hold (RSS growth < 10 %, no fd growth, no task growth, zero errors). Task counts move with the
streams in flight and descriptor counts with the worker restart cycle (connections and event
sockets to the restarted worker come and go), so for both "no growth" means the last window's
median is within the warm window's range; RSS each minute shows whether memory levels off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import free_port, get_json, percentile  # noqa: E402
from frontend_load import Connection, make_prompts, stream_request  # noqa: E402

SUPERVISOR = "supervisor"


# ------------------------------------------------------------------------------------------------
# Processes.


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _label(pid: int) -> str | None:
    """``frontend``, ``worker@<system port>`` (stable across restarts: the spec's argv), or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "--role" not in argv:
        return None
    role = argv[argv.index("--role") + 1]
    if "--system-port" in argv:
        return f"{role}@{argv[argv.index('--system-port') + 1]}"
    return role if role == "frontend" else f"{role}-{pid}"


def _proc_sample(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if fields.get("State", "").strip().startswith("Z"):
        return None
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "fds": fds, "threads": int(fields["Threads"])}


TASKS_METRIC = "dynamo_process_asyncio_tasks"


def metrics_url(label: str, frontend_url: str) -> str | None:
    """Where a labelled process serves ``/metrics``: a worker on its --system-port, the frontend
    on its HTTP port."""
    if label == "frontend":
        return frontend_url + "/metrics"
    if "@" in label:
        return f"http://127.0.0.1:{label.split('@', 1)[1]}/metrics"
    return None


def scrape_tasks(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(TASKS_METRIC + " "):
            return int(float(line.split()[1]))
    return None


def _median(values: list[int]) -> float | None:
    return percentile(values, 0.5) if values else None


def _each_minute(run: list[tuple[float, int, int, int, int, int]]) -> list[tuple[float, int, int, int, int, int]]:
    """The first sample at or after each whole minute of ``run`` (by its time field)."""
    out, next_t = [], 0.0
    for s in run:
        if s[0] >= next_t:
            out.append(s)
            next_t = (int(s[0] // 60) + 1) * 60.0
    return out


@dataclass
class Series:
    """One process label's samples: (t, pid, rss_kb, fds, threads, asyncio tasks or -1)."""

    samples: list[tuple[float, int, int, int, int, int]] = field(default_factory=list)

    @staticmethod
    def windowed(run: list[tuple[float, int, int, int, int, int]], warm_t: float, index: int,
                 prefix: str, growth: str) -> dict[str, Any]:
        """Field ``index`` of the warm window (up to ``warm_t``) against the last window of the
        same length: growth is the change of the median, and the target holds when the last
        median is within the warm window's range. Streams in flight move task counts, and a
        worker restart cycle moves descriptor counts (its connections and event sockets come and
        go), so two single samples would report the phase of that cycle, not growth."""
        have = [s for s in run if s[index] >= 0]
        if not have:
            return {f"{prefix}_warm_median": None, f"{prefix}_end_median": None, f"{growth}_growth": None,
                    f"{growth}_growth_ok": None}
        end_t = have[-1][0]
        warm = [s[index] for s in have if s[0] <= warm_t] or [have[0][index]]
        last = [s[index] for s in have if s[0] >= end_t - warm_t] or [have[-1][index]]
        warm_med, last_med = _median(warm), _median(last)
        return {
            f"{prefix}_warm_median": warm_med, f"{prefix}_warm_max": max(warm),
            f"{prefix}_end_median": last_med, f"{prefix}_end_max": max(last),
            f"{growth}_growth": None if warm_med is None or last_med is None else last_med - warm_med,
            f"{growth}_growth_ok": last_med is not None and last_med <= max(warm),
        }

    def pids(self) -> list[int]:
        return list(dict.fromkeys(s[1] for s in self.samples))

    def summary(self, warm_t: float) -> dict[str, Any]:
        last_pid = self.samples[-1][1]
        run = [s for s in self.samples if s[1] == last_pid]  # the last incarnation
        base = next((s for s in run if s[0] >= warm_t), run[0])
        last = run[-1]
        first = run[0]
        return {
            "pids": self.pids(),
            "restarts": len(self.pids()) - 1,
            "samples": len(run),
            "baseline_at_s": round(base[0], 1),
            "rss_kb_start": first[2],
            "rss_kb_baseline": base[2],
            "rss_kb_end": last[2],
            "rss_kb_max": max(s[2] for s in run),
            "rss_growth_pct": round(100.0 * (last[2] - base[2]) / base[2], 2) if base[2] else None,
            "fds_start": first[3],
            "fds_baseline": base[3],
            "fds_end": last[3],
            "fds_max": max(s[3] for s in run),
            "fd_change": last[3] - base[3],
            "threads_baseline": base[4],
            "threads_end": last[4],
            # RSS each minute of the last incarnation: a plateau is warm-up (caches filling), a
            # steady climb is a leak.
            "rss_mb_by_minute": [round(s[2] / 1024, 1) for s in _each_minute(run)],
            **self.windowed(run, warm_t, 3, "fds", "fd"),
            **self.windowed(run, warm_t, 5, "tasks", "task"),
        }


class Sampler:
    def __init__(self, up_pid: int, frontend_url: str) -> None:
        self.up_pid = up_pid
        self.frontend_url = frontend_url
        self.series: dict[str, Series] = {}

    def sample(self, t: float) -> None:
        labelled = [(SUPERVISOR, self.up_pid)] + [
            (label, pid) for pid in _descendants(self.up_pid) if (label := _label(pid)) is not None
        ]
        for label, pid in labelled:
            got = _proc_sample(pid)
            if got is not None:
                url = metrics_url(label, self.frontend_url)
                tasks = scrape_tasks(url) if url else None
                self.series.setdefault(label, Series()).samples.append(
                    (t, pid, got["rss_kb"], got["fds"], got["threads"], -1 if tasks is None else tasks)
                )

    def pid_of(self, label: str) -> int | None:
        for pid in _descendants(self.up_pid):
            if _label(pid) == label and _proc_sample(pid) is not None:
                return pid
        return None


# ------------------------------------------------------------------------------------------------
# Load.


@dataclass
class Outcome:
    t: float  # seconds since the load started, at the request's start
    kind: str
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    wanted: int = 0
    error: str = ""


KINDS = {  # name: (prompt tokens, max tokens, share of requests)
    "short": (64, 16, 0.7),
    "long": (768, 128, 0.3),
}


async def load(url: str, model: str, args: argparse.Namespace, stop: asyncio.Event, t0: float) -> list[Outcome]:
    host, port = url.removeprefix("http://").split(":")
    prompts = {k: make_prompts(200, p, seed=i) for i, (k, (p, _m, _s)) in enumerate(KINDS.items())}
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []

    async def loop(i: int) -> None:
        conn = Connection(host, int(port))
        while not stop.is_set():
            kind = rng.choices(list(KINDS), weights=[v[2] for v in KINDS.values()])[0]
            _p, max_tokens, _s = KINDS[kind]
            body = json.dumps({
                "model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": rng.choice(prompts[kind])}],
            }).encode()
            start = time.monotonic() - t0
            try:
                r = await asyncio.wait_for(stream_request(conn, "/v1/chat/completions", body, True), args.request_timeout)
                outcomes.append(Outcome(start, kind, True, r.ttft, r.itls, r.tokens, max_tokens))
            except Exception as exc:  # noqa: BLE001 - every failure is a finding to count
                conn.close()
                outcomes.append(Outcome(start, kind, False, wanted=max_tokens, error=f"{type(exc).__name__}: {exc}"[:200]))

    await asyncio.gather(*(loop(i) for i in range(args.concurrency)))
    return outcomes


def latency(outcomes: list[Outcome], lo: float, hi: float) -> dict[str, Any]:
    window = [o for o in outcomes if lo <= o.t < hi]
    ok = [o for o in window if o.ok]
    ttft = [o.ttft * 1000 for o in ok]
    itl = [x * 1000 for o in ok for x in o.itls]
    return {
        "from_s": round(lo, 1), "to_s": round(hi, 1), "requests": len(window), "errors": len(window) - len(ok),
        "ttft_ms_p50": round(percentile(ttft, 0.5), 2), "ttft_ms_p99": round(percentile(ttft, 0.99), 2),
        "itl_ms_p50": round(percentile(itl, 0.5), 2), "itl_ms_p99": round(percentile(itl, 0.99), 2),
    }


# ------------------------------------------------------------------------------------------------
# The run.


def start_up(args: argparse.Namespace, root: Path, port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-P", "-m", "dynamod.daemon.cli", "up", "--workers", str(args.workers),
            "--http-port", str(port), "--file-kv", str(root / "kv"), "--log-dir", str(root / "logs"),
            "--speedup-ratio", str(args.speedup_ratio), "--router-mode", args.router_mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    log = open(root / "up.log", "wb")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, workers: int, up: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"dynamod up exited with {up.returncode}")
        for m in (get_json(url + "/health") or {}).get("models", []):
            if not m.get("lora") and int(m.get("ready", 0)) >= workers:
                return str(m["model"])
        time.sleep(0.25)
    raise SystemExit(f"cluster not ready after {timeout_s}s")


async def restarter(sampler: Sampler, target: str, every_s: float, stop: asyncio.Event, log: list[dict]) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass
        pid = await asyncio.to_thread(sampler.pid_of, target)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        log.append({"at_s": round(time.monotonic() - t0, 1), "target": target, "pid": pid})


async def sampling(sampler: Sampler, every_s: float, stop: asyncio.Event, t0: float) -> None:
    while True:
        await asyncio.to_thread(sampler.sample, time.monotonic() - t0)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="dynamod-soak-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = start_up(args, root, port)
    try:
        model = await asyncio.to_thread(wait_ready, url, args.workers, up, 120.0)
        sampler = Sampler(up.pid, url)
        workers = sorted(label for pid in _descendants(up.pid) if (label := _label(pid)) and label.startswith("agg@"))
        target = workers[0]
        stop = asyncio.Event()
        restarts: list[dict] = []
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(sampling(sampler, args.sample_every, stop, t0)),
            asyncio.create_task(restarter(sampler, target, args.restart_every, stop, restarts)),
        ]
        load_task = asyncio.create_task(load(url, model, args, stop, t0))
        await asyncio.sleep(args.duration)
        stop.set()
        outcomes = await load_task
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    window = min(args.window, elapsed / 2)
    processes = {label: s.summary(window) for label, s in sorted(sampler.series.items())}
    errors = [o for o in outcomes if not o.ok]
    short = [o for o in outcomes if o.ok and o.tokens < o.wanted]
    steady = {k: v for k, v in processes.items() if k != target}
    result = {
        "bench": "soak",
        "config": {k: getattr(args, k) for k in ("duration", "workers", "restart_every", "concurrency",
                                                  "speedup_ratio", "router_mode", "sample_every", "window")},
        "kinds": {k: {"prompt_tokens": p, "max_tokens": m, "share": s} for k, (p, m, s) in KINDS.items()},
        "elapsed_s": round(elapsed, 1),
        "restart_target": target,
        "restarts_sent": len(restarts),
        "requests": len(outcomes),
        "errors": len(errors),
        "error_samples": sorted({o.error for o in errors})[:10],
        "short_streams": len(short),
        "latency_first_window": latency(outcomes, 0, window),
        "latency_last_window": latency(outcomes, elapsed - window, elapsed + 1),
        "processes": processes,
        "dynamod_up_exit": up.returncode,
        "targets": {
            "rss_growth_lt_10pct": all((p["rss_growth_pct"] or 0) < 10 for p in steady.values()),
            "no_fd_growth": all(p["fd_growth_ok"] is not False for p in steady.values()),
            "no_task_growth": all(p["task_growth_ok"] is not False for p in steady.values()),
            "zero_errors": not errors,
            "checked_on": sorted(steady),
        },
    }
    if args.keep_logs:
        result["logs"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--workers", type=int, default=3, help="mocker workers; the first is restarted periodically")
    p.add_argument("--restart-every", type=float, default=30.0, help="seconds between SIGTERMs to the restart target")
    p.add_argument("--concurrency", type=int, default=8, help="streams in flight")
    p.add_argument("--speedup-ratio", type=float, default=5.0, help="mocker speedup")
    p.add_argument("--router-mode", default="kv")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between /proc samples")
    p.add_argument("--window", type=float, default=60.0, help="first/last window for latency; RSS baseline at its end")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep the cluster's directory (logs) and print its path")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(soak(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
