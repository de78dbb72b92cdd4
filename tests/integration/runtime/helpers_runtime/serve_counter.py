"""A child process that serves ``counter`` (yields 0..n-1, optionally slowly) on a real runtime.

Settings come from DYN_* env like any daemon. Prints ``READY <instance_id hex> <status_url>`` once
served and exits 0 after SIGTERM, letting in-flight streams finish (graceful shutdown under test).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from dynamod.daemon.lifecycle import run_role
from dynamod.shared.config import add_runtime_args, settings_from_args
from dynamod.shared.observability.logging import configure_logging
from dynamod.shared.runtime.distributed import DistributedRuntime


async def counter(body, ctx):
    n = int(body.get("n", 1))
    delay = float(body.get("delay", 0.0))
    for i in range(n):
        if delay:
            await asyncio.sleep(delay)
        yield {"i": i}


async def main(args, stop: asyncio.Event) -> int:
    rt = await DistributedRuntime.create(settings_from_args(args))
    served = await rt.namespace().component(args.component).endpoint("counter").serve(counter, role="test")
    print(f"READY {served.instance_id:x} {rt.status_url}", flush=True)
    await stop.wait()
    await rt.shutdown(grace_s=10)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--component", default="echo")
    add_runtime_args(parser)
    ns = parser.parse_args()
    configure_logging()
    sys.exit(run_role(lambda stop: main(ns, stop), name="serve_counter"))
