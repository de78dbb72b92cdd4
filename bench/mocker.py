"""Mocker engine throughput: how fast one core steps, and how many paced workers one CPU drives.

Prints one JSON document:

- ``core``: for one ``MockerCore`` with Dynamo's default engine arguments under steady load (a
  new request replaces each finished one, so the batch stays full), simulated engine steps per
  wall second with no pacing, plus tokens per second and how much faster than real time it runs.
- ``engines``: ``N`` ``MockerEngine`` workers in one asyncio loop (uvloop when installed), each with
  ``--concurrency`` streaming clients (output lengths vary +-50% around ``--osl``), at
  ``--speedup-ratio``. For each N: ``pace`` = simulated time advanced / (busy wall time x
  speedup) per worker (1.0 = on schedule), step-loop lag, and process CPU use.
  ``max_workers_keeping_pace`` is the largest N whose slowest worker keeps pace >= 0.95 with no
  clock resets; ``max_workers_with_mean_lag_under_1ms`` also asks that tokens arrive on time
  (mean step lag within the 1 ms timer resolution); ``projected_workers_per_core`` is the number
  of workers one fully available core could pace, from the measured CPU cost per worker.

Usage: ``python bench/mocker.py [--duration 3] [--speedup-ratio 10] [--concurrency 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions

VOCAB = 32000


def _prompt(rng: random.Random, isl: int, prefix: list[int]) -> list[int]:
    return prefix + [rng.randrange(VOCAB) for _ in range(isl - len(prefix))]


def bench_core(batch: int, isl: int, osl: int, steps: int) -> dict:
    """Steps one core back to back with ``batch`` requests always in flight."""
    rng = random.Random(batch)
    core = MockerCore(MockerConfig())
    prefix = [rng.randrange(VOCAB) for _ in range(isl // 2)]  # half of each prompt is shared
    # Prompts and lengths are made up front so the timed loop measures the core, not the bench.
    prompts = [_prompt(rng, isl, prefix) for _ in range(256)]
    lengths = [rng.randint(osl // 2, osl * 3 // 2) for _ in range(256)]
    n = 0

    def add() -> None:
        nonlocal n
        core.add_request(f"r{n}", prompts[n % 256], max_tokens=lengths[n % 256], ignore_eos=True)
        n += 1

    for _ in range(batch):
        add()
    for _ in range(steps // 10):  # warm up into steady state
        for _fin in core.step().finished:
            add()
    tokens = 0
    sim_ms = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        out = core.step()
        tokens += len(out.token_ids)
        sim_ms += out.duration_ms
        for _fin in out.finished:
            add()
    wall = time.perf_counter() - start
    return {
        "batch": batch,
        "isl": isl,
        "osl": osl,
        "steps_per_s": round(steps / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "us_per_step": round(wall / steps * 1e6, 1),
        "simulated_x_realtime": round(sim_ms / 1000.0 / wall, 1),
    }


async def _client(engine: MockerEngine, name: str, isl: int, osl: int, stop: asyncio.Event) -> None:
    rng = random.Random(name)
    prefix = [rng.randrange(VOCAB) for _ in range(isl // 2)]
    prompts = [_prompt(rng, isl, prefix) for _ in range(4)]
    i = 0
    while not stop.is_set():
        # Output lengths vary so that clients do not finish in lockstep.
        req = PreprocessedRequest(
            request_id=f"{name}-{i}",
            model="mock",
            token_ids=prompts[i % 4],
            stop=StopConditions(max_tokens=rng.randint(osl // 2, osl * 3 // 2), ignore_eos=True),
        )
        i += 1
        async for _out in engine.generate(req):
            if stop.is_set():
                break


async def bench_engines(workers: int, concurrency: int, isl: int, osl: int, speedup: float, duration: float) -> dict:
    cfg = MockerConfig(speedup_ratio=speedup)
    engines = [MockerEngine(cfg, worker_id=i + 1) for i in range(workers)]
    for engine in engines:
        await engine.start()
    stop = asyncio.Event()
    clients = [
        asyncio.create_task(_client(engine, f"w{w}c{c}", isl, osl, stop))
        for w, engine in enumerate(engines)
        for c in range(concurrency)
    ]
    await asyncio.sleep(min(1.0, duration / 3))  # warm up: prefill burst, steady decode

    def snapshot() -> list[tuple[float, float, int, int, float]]:
        out = []
        for engine in engines:
            (st,) = engine.loop_stats()
            out.append((st.simulated_ms, st.lag_sum_s, st.steps, st.clock_resets, st.idle_s))
        return out

    before, wall0, cpu0 = snapshot(), time.perf_counter(), time.process_time()
    lag_max_before = [engine.loop_stats()[0].lag_max_s for engine in engines]
    await asyncio.sleep(duration)
    after, wall, cpu = snapshot(), time.perf_counter() - wall0, time.process_time() - cpu0
    stop.set()
    for engine in engines:
        await engine.stop()
    await asyncio.gather(*clients, return_exceptions=True)

    paces, lags, steps, resets = [], [], 0, 0
    for (s0, l0, n0, r0, i0), (s1, l1, n1, r1, i1) in zip(before, after, strict=True):
        # Pace over the time the worker had work (a client re-submitting can leave it idle).
        paces.append((s1 - s0) / speedup / 1000.0 / max(wall - (i1 - i0), 1e-9))
        lags.append((l1 - l0) / max(n1 - n0, 1))
        steps += n1 - n0
        resets += r1 - r0
    lag_max = max(e.loop_stats()[0].lag_max_s for e in engines)
    return {
        "workers": workers,
        "pace_mean": round(sum(paces) / len(paces), 3),
        "pace_min": round(min(paces), 3),
        "lag_mean_ms": round(sum(lags) / len(lags) * 1000, 3),
        "lag_max_ms": round(max(lag_max, *lag_max_before) * 1000, 2),
        "clock_resets": resets,
        "steps_per_s_total": round(steps / wall, 1),
        "cpu_utilization": round(cpu / wall, 2),
        "cpu_us_per_step": round(cpu / max(steps, 1) * 1e6, 1),
    }


async def sweep_engines(args: argparse.Namespace) -> dict:
    results = []
    best = 0
    workers = 1
    while workers <= args.max_workers:
        r = await bench_engines(workers, args.concurrency, args.isl, args.osl, args.speedup_ratio, args.duration)
        results.append(r)
        print(json.dumps(r), file=sys.stderr)
        if r["pace_min"] >= 0.95 and r["clock_resets"] == 0:
            best = workers
        else:
            break
        workers *= 2
    # Refine between the last good and the first bad power of two.
    if results and best and best < results[-1]["workers"]:
        lo, hi = best, results[-1]["workers"]
        while hi - lo > max(1, lo // 4):
            mid = (lo + hi) // 2
            r = await bench_engines(mid, args.concurrency, args.isl, args.osl, args.speedup_ratio, args.duration)
            results.append(r)
            print(json.dumps(r), file=sys.stderr)
            if r["pace_min"] >= 0.95 and r["clock_resets"] == 0:
                lo = best = mid
            else:
                hi = mid
    # Stricter: also deliver tokens on time, i.e. mean step lag within the timer resolution (1 ms).
    low_lag = [r["workers"] for r in results if r["pace_min"] >= 0.95 and r["clock_resets"] == 0 and r["lag_mean_ms"] <= 1.0]
    paced = [r for r in results if r["workers"] == best]
    projected = round(best / paced[0]["cpu_utilization"], 1) if paced and paced[0]["cpu_utilization"] else None
    return {
        "max_workers_with_mean_lag_under_1ms": max(low_lag, default=0),
        "projected_workers_per_core": projected,
        "speedup_ratio": args.speedup_ratio,
        "concurrency_per_worker": args.concurrency,
        "isl": args.isl,
        "osl": args.osl,
        "max_workers_keeping_pace": best,
        "runs": sorted(results, key=lambda r: r["workers"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per engine run")
    parser.add_argument("--speedup-ratio", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8, help="streaming clients per worker")
    parser.add_argument("--isl", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=128, help="output tokens")
    parser.add_argument("--core-steps", type=int, default=3000)
    parser.add_argument("--max-workers", type=int, default=256)
    args = parser.parse_args()

    core = [bench_core(batch, args.isl, args.osl, args.core_steps) for batch in (8, 64, 256)]
    try:
        import uvloop

        runner = uvloop.run
        loop_name = "uvloop"
    except ImportError:
        runner = asyncio.run
        loop_name = "asyncio"
    engines = runner(sweep_engines(args))
    print(json.dumps({"core": core, "engines": {"event_loop": loop_name, **engines}}, indent=2))


if __name__ == "__main__":
    main()
