"""Small helpers the benchmarks share: ports, health reads, percentiles, and the yardsticks of an
in-process run (how fast this machine runs Python right now, the process's RSS)."""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import time
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The JSON body at ``url``, or None while the server is not answering."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100.0 * len(s)))]


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
    out = {
        f"p50_{unit}": round(percentile(values, 50) * scale, digits),
        f"p99_{unit}": round(percentile(values, 99) * scale, digits),
    }
    if with_max:
        out[f"max_{unit}"] = round(max(values) * scale, digits)
    out[f"mean_{unit}"] = round(statistics.fmean(values) * scale, digits)
    out["n"] = len(values)
    return out

