"""A request-plane server in its own process, for the transport integration tests and the benchmark.

Prints one JSON line ``{"transport": ..., "address": ..., "pid": ...}`` once it serves, then
``{"event": "stopping"}`` when SIGTERM starts a graceful stop and ``{"event": "stopped"}`` at the end.
The ``test/stats`` endpoint reports what the handlers saw (started, finished, progress) and the
server's own counters, so a test in another process can check that a cancel reached a handler.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.transport.factory import make_server
from dynamod.shared.transport.plane import RequestContext

started: dict[str, int] = {}
finished: dict[str, str] = {}
progress: dict[str, int] = {}


async def count(body: dict[str, Any], ctx: RequestContext):
    """Yields 0..n-1, optionally padded, as fast as the client's credit allows."""
    pad = "x" * int(body.get("pad", 0))
    for i in range(int(body["n"])):
        yield [i, pad] if pad else i


async def echo(body: Any, ctx: RequestContext):
    yield body


async def fail(body: Any, ctx: RequestContext):
    raise InvalidRequestError(f"rejected {body!r}", param="body")
    yield  # pragma: no cover - makes this an async generator


async def hang(body: Any, ctx: RequestContext):
    """Says it started, then waits until cancelled; records how it ended."""
    started[ctx.request_id] = 1
    outcome = "returned"
    try:
        yield "started"
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except GeneratorExit:
        outcome = "closed"
        raise
    finally:
        finished[ctx.request_id] = outcome


async def produce(body: Any, ctx: RequestContext):
    """Yields forever, recording how many items the server got to send."""
    i = 0
    try:
        while True:
            progress[ctx.request_id] = i
            yield i
            i += 1
    finally:
        finished[ctx.request_id] = "closed"


async def paced(body: dict[str, Any], ctx: RequestContext):
    """``n`` items, ``interval_s`` apart: a stream that is still running when the server is told to stop."""
    for i in range(int(body["n"])):
        if i:
            await asyncio.sleep(float(body["interval_s"]))
        yield i


def _stats_handler(server: Any):
    async def stats(body: Any, ctx: RequestContext):
        yield {
            "inflight": server.inflight - 1,  # not counting this stats request
            "started": list(started),
            "finished": finished,
            "progress": progress,
            "server": server.stats() if hasattr(server, "stats") else {},
        }

    return stats


HANDLERS = {"count": count, "echo": echo, "fail": fail, "hang": hang, "produce": produce, "paced": paced}


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    server = make_server(
        args.transport, port=args.port, nats_url=args.nats_url, max_frame_bytes=args.max_frame_bytes
    )
    for name, handler in HANDLERS.items():
        server.register(f"test/{name}", handler)
    server.register("test/stats", _stats_handler(server))
    address = await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    _say({"transport": address.transport, "address": address.address, "pid": os.getpid()})
    await stop.wait()
    _say({"event": "stopping"})
    await server.stop(grace_s=args.grace_s)
    _say({"event": "stopped"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "nats"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--nats-url", default=None)
    parser.add_argument("--max-frame-bytes", type=int, default=1024 * 1024)
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("--uvloop", action="store_true")
    ns = parser.parse_args()
    if ns.uvloop:
        import uvloop

        uvloop.run(main(ns))
    else:
        asyncio.run(main(ns))
