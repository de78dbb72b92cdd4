"""Small helpers the benchmarks share: ports, health reads, percentiles, and the yardsticks of an
in-process run (how fast this machine runs Python right now, the process's RSS).

``percentile``/``percentiles`` are ``dynamod.shared.stats``'s (linear interpolation, ``q`` a
fraction: 0.99 for p99), so a benchmark's p99 means what a replay's and the product's mean."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from dynamod.shared.stats import percentile, percentiles
    from dynamod.shared.transport.ports import free_port
except ImportError:  # a bare checkout (frontend_load.py on a client box): the same modules by their paths

    def _load_shared(relative: str) -> Any:
        path = Path(__file__).resolve().parent.parent / "shared" / relative
        spec = importlib.util.spec_from_file_location("dynamod_shared_" + path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    _stats = _load_shared("stats.py")
    percentile, percentiles = _stats.percentile, _stats.percentiles
    free_port = _load_shared("transport/ports.py").free_port

__all__ = ["calibrate", "free_port", "get_json", "latency_summary", "percentile", "percentiles", "rss_mb", "stop_processes"]


def get_json(url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The JSON body at ``url``, or None while the server is not answering."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def calibrate() -> float:
    """ns per dict insert in a plain loop: a yardstick for how fast this machine runs Python
    right now (every figure of a run scales with it; on a shared box it moves during a run)."""
    keys = [random.getrandbits(64) for _ in range(200_000)]
    best = float("inf")
    for _ in range(3):
        d: dict[int, int] = {}
        t0 = time.thread_time()
        for k in keys:
            d[k] = k
        best = min(best, time.thread_time() - t0)
    return round(best / len(keys) * 1e9, 1)


def rss_mb() -> float:
    """This process's resident memory in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def latency_summary(values: list[float], *, unit: str = "us", digits: int = 1, with_max: bool = True) -> dict[str, float]:
    """p50/p99(/max)/mean of durations in seconds, in ``unit`` ("us" or "ms"), keys named after it."""
    scale = {"us": 1e6, "ms": 1e3}[unit]
    p50, p99 = percentiles(values, (0.5, 0.99))
    out = {f"p50_{unit}": round(p50 * scale, digits), f"p99_{unit}": round(p99 * scale, digits)}
    if with_max:
        out[f"max_{unit}"] = round(max(values) * scale, digits)
    out[f"mean_{unit}"] = round(statistics.fmean(values) * scale, digits)
    out["n"] = len(values)
    return out



def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every process in order (all at once, so their graceful stops overlap), then wait up to
    ``grace_s`` for each and SIGKILL the ones still running."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
