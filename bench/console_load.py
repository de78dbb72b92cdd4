"""Console under load: 256 simulated workers, 10 load updates a second each, into a real console.

    python bench/console_load.py [--workers 256] [--rate 10] [--duration 20] [--size 160x50] [--view workers]

A feeder process registers the workers in file discovery (each with its own lease, generate
endpoint and model card) and publishes their ``kv_metrics`` over the ZMQ event plane, plus a few
router decisions; this process runs the console app headless with its real collectors, and
measures while the feed runs:

- refresh time: one ``ConsoleApp.refresh_now()`` (state -> widgets of the shown view), p50/p99;
- CPU of the console process (all its threads, rendering included) in cores;
- updates received per second (what the console actually consumed).

``--direct`` skips the feeder and the event plane and calls ``ClusterState`` from a task in this
process instead (CPU then includes the feed). Prints one JSON object. Targets: refresh p99 under
100 ms, CPU under half a core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dynamod.shared.stats import percentile

NAMESPACE = "bench"


# -- feeder (a separate process: the simulated cluster) -------------------------------------------


async def _feed(file_kv: str, workers: int, rate: float, ready_path: str, stop_after: float) -> None:
    import msgspec

    from dynamod.shared.config import RuntimeSettings
    from dynamod.shared.events.plane import TOPIC_KV_METRICS, TOPIC_ROUTER_DECISIONS
    from dynamod.shared.protocol.keys import mdc_key
    from dynamod.shared.protocol.load import LoadMetrics, load_encoder
    from dynamod.shared.protocol.model_card import ModelCard, encode_card
    from dynamod.shared.runtime.distributed import DistributedRuntime

    settings = RuntimeSettings(namespace=NAMESPACE, discovery_backend="file", file_kv=file_kv, event_plane="zmq")
    rt = await DistributedRuntime.create(settings.validate())
    comp = rt.namespace(NAMESPACE).component("backend")

    async def handler(body, ctx):  # noqa: ANN001 - request-plane handler signature
        yield {"status": "ok"}

    card = encode_card(ModelCard(served_model_name="bench-model", kv_block_size=16))
    ids: list[int] = []
    for i in range(workers):
        lease = rt.lease if i == 0 else await rt.create_lease()
        assert lease is not None
        await comp.endpoint("generate").serve(handler, lease=lease, role="agg", model="bench-model")
        await rt.store.put(mdc_key(NAMESPACE, "backend", "generate", lease.id), card, lease)
        ids.append(lease.id)
    load_pub = await comp.publisher(TOPIC_KV_METRICS)
    decision_pub = await comp.publisher(TOPIC_ROUTER_DECISIONS)
    await asyncio.to_thread(Path(ready_path).write_text, json.dumps(ids))
    rnd = random.Random(1)
    running = dict.fromkeys(ids, 4)
    period = 1.0 / rate
    loop = asyncio.get_running_loop()
    start = next_tick = loop.time()
    sent = 0
    while loop.time() - start < stop_after:
        for wid in ids:
            running[wid] = max(0, min(64, running[wid] + rnd.randint(-2, 2)))
            m = LoadMetrics(worker_id=wid, num_running=running[wid], num_waiting=rnd.randint(0, 2),
                            kv_usage=running[wid] / 64, total_blocks=4096, prefix_hit_rate=0.5, ts=time.time())
            await load_pub.publish(TOPIC_KV_METRICS, load_encoder.encode(m))
            sent += 1
        chosen = rnd.sample(ids, min(4, len(ids)))
        decision = {"worker_id": chosen[0], "overlap_blocks": 3,
                    "candidates": [{"worker_id": w, "overlap_blocks": 3, "prefill_blocks": 5, "decode_blocks": 9, "cost": 14 + j}
                                   for j, w in enumerate(chosen)]}
        await decision_pub.publish(TOPIC_ROUTER_DECISIONS, msgspec.msgpack.encode(decision))
        next_tick += period
        await asyncio.sleep(max(0.0, next_tick - loop.time()))
    await rt.shutdown(grace_s=0.0)


# -- console side ---------------------------------------------------------------------------------


async def _direct_feed(state, workers: int, rate: float, stop: asyncio.Event) -> None:  # noqa: ANN001
    from dynamod.shared.protocol.instance import Instance
    from dynamod.shared.protocol.keys import instance_key
    from dynamod.shared.protocol.load import LoadMetrics

    ids = [0x7000_0000_0000 + i for i in range(workers)]
    for wid in ids:
        inst = Instance(namespace=NAMESPACE, component="backend", endpoint="generate", instance_id=wid, transport="tcp",
                        address="127.0.0.1:1", role="agg", model="bench-model", started_at=time.time())
        state.put_instance(instance_key(NAMESPACE, "backend", "generate", wid), inst)
    rnd = random.Random(1)
    period = 1.0 / rate
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    while not stop.is_set():
        for wid in ids:
            state.apply_load(LoadMetrics(worker_id=wid, num_running=rnd.randint(0, 64), kv_usage=rnd.random()))
        next_tick += period
        await asyncio.sleep(max(0.0, next_tick - loop.time()))


async def _run_console(args: argparse.Namespace) -> dict:
    from dynamod.console.collectors.connection import ClusterConnection
    from dynamod.console.settings import ConsoleSettings
    from dynamod.console.state.cluster import ClusterState
    from dynamod.console.tui.app import ConsoleApp

    width, height = (int(x) for x in args.size.split("x"))
    state = ClusterState()
    tmp = tempfile.mkdtemp(prefix="dynamod-console-bench-")
    file_kv = os.path.join(tmp, "file-kv")
    feeder = None
    stop_direct = asyncio.Event()
    direct_task = None
    if args.direct:
        connection = None
        direct_task = asyncio.create_task(_direct_feed(state, args.workers, args.rate, stop_direct))
    else:
        ready = os.path.join(tmp, "ready.json")
        feeder = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--feeder", "--file-kv", file_kv, "--workers", str(args.workers),
            "--rate", str(args.rate), "--ready-file", ready, "--stop-after", str(args.duration + args.warmup + 120),
        )
        deadline = time.monotonic() + 180
        while not await asyncio.to_thread(os.path.exists, ready):
            if feeder.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError("the feeder did not come up")
            await asyncio.sleep(0.2)
        settings = ConsoleSettings(discovery="file", file_kv=file_kv, namespace=NAMESPACE, frontend_urls=[])
        connection = ClusterConnection(settings, state)
    app = ConsoleApp(state, connection=connection, refresh_s=args.refresh, initial_view=args.view)
    app_task = asyncio.create_task(app.run_async(headless=True, size=(width, height)))
    try:
        deadline = time.monotonic() + 120
        while True:
            workers = state.worker_list(include_gone=False)
            if len(workers) >= args.workers and all(w.stats.loads for w in workers):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(workers)} workers reached the console")
            if app_task.done():
                app_task.result()
            await asyncio.sleep(0.2)
        await asyncio.sleep(args.warmup)
        app.refresh_times.clear()
        updates0 = state.counters["load_updates"]
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(args.duration)
        cpu1, wall1 = time.process_time(), time.monotonic()
        updates = state.counters["load_updates"] - updates0
        samples = [t * 1000 for t in app.refresh_times]
    finally:
        app.exit()
        try:
            await asyncio.wait_for(app_task, 30)
        except (TimeoutError, asyncio.CancelledError):
            pass
        stop_direct.set()
        if direct_task is not None:
            await direct_task
        if feeder is not None and feeder.returncode is None:
            feeder.terminate()
            await asyncio.wait_for(feeder.wait(), 30)
    elapsed = wall1 - wall0
    return {
        "bench": "console_load",
        "mode": "direct" if args.direct else "zmq+file-discovery",
        "workers": args.workers,
        "updates_per_worker_per_s": args.rate,
        "target_updates_per_s": args.workers * args.rate,
        "received_updates_per_s": round(updates / elapsed, 1),
        "view": args.view,
        "terminal": args.size,
        "refresh_interval_s": args.refresh,
        "duration_s": round(elapsed, 2),
        "refreshes": len(samples),
        "refresh_ms": {
            "p50": round(percentile(samples, 0.5, default=float("nan")), 3),
            "p99": round(percentile(samples, 0.99, default=float("nan")), 3),
            "max": round(max(samples), 3) if samples else None,
            "mean": round(statistics.fmean(samples), 3) if samples else None,
        },
        "console_cpu_cores": round((cpu1 - cpu0) / elapsed, 3),
        "targets": {"refresh_p99_ms": 100, "cpu_cores": 0.5},
    }


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").strip().split("\n\n")[0])
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--rate", type=float, default=10.0, help="load updates per second per worker [default 10]")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds [default 20]")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--size", default="160x50", help="terminal size WxH [default 160x50]")
    p.add_argument("--view", default="workers", help="view shown while measuring [default workers]")
    p.add_argument("--refresh", type=float, default=0.5, help="console refresh interval [default 0.5]")
    p.add_argument("--direct", action="store_true", help="feed ClusterState in-process instead of over ZMQ")
    p.add_argument("--feeder", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--file-kv", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--stop-after", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.feeder:
        asyncio.run(_feed(args.file_kv, args.workers, args.rate, args.ready_file, args.stop_after))
        return 0
    print(json.dumps(asyncio.run(_run_console(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
