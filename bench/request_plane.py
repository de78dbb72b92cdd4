"""Request-plane throughput and latency between two processes.

    python bench/request_plane.py [--transports tcp,nats] [--requests 5000] [--messages 200000]
                                  [--concurrency 16] [--no-uvloop]

Starts a server process (this script with ``--serve``) and measures from this process:

- ``rtt_p50_us`` / ``rtt_p99_us`` / ``rtt_mean_us``: one small request -> one small response,
  sequential, end frame included (what a control call or a one-token reply costs);
- ``stream_msgs_per_s``: one request answered by ``--messages`` small responses (a token stream);
- ``concurrent_stream_msgs_per_s``: ``--concurrency`` such streams at once on the same connection
  (``--messages`` in total);
- ``cpu_us_per_msg_client`` / ``cpu_us_per_msg_server``: CPU time per streamed message on each
  side during the single-stream run, so the figures can be read on a busy machine.

NATS runs only when a ``nats-server`` binary is on PATH; the script starts one on a free loopback
port. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dynamod.shared.stats import percentile_of_sorted
from dynamod.shared.transport.ports import free_port

_CLK_TCK = os.sysconf("SC_CLK_TCK")
SMALL_BODY = {"token_ids": [1234], "finish_reason": None}


# -- server side ----------------------------------------------------------------------------------


async def _serve(transport: str, nats_url: str | None) -> None:
    from dynamod.shared.transport.factory import make_server

    async def echo(body: Any, ctx: Any):
        yield body

    async def stream(body: Any, ctx: Any):
        item = SMALL_BODY
        for _ in range(int(body["n"])):
            yield item

    server = make_server(transport, nats_url=nats_url)
    server.register("bench/echo", echo)
    server.register("bench/stream", stream)
    address = await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(json.dumps({"transport": address.transport, "address": address.address}), flush=True)
    await stop.wait()
    await server.stop(grace_s=1)


# -- client side ----------------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


async def _measure(
    address: Any, nats_url: str | None, server_pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    from dynamod.shared.transport.factory import make_client

    client = make_client(nats_url=nats_url)
    try:
        # Warm up: connection, code paths, allocator.
        for _ in range(200):
            async for _item in client.stream(address, "bench/echo", SMALL_BODY):
                pass
        async for _item in client.stream(address, "bench/stream", {"n": 5000}):
            pass

        lat: list[float] = []
        clock = time.perf_counter
        for _ in range(args.requests):
            t0 = clock()
            async for _item in client.stream(address, "bench/echo", SMALL_BODY):
                pass
            lat.append(clock() - t0)
        lat.sort()

        n = args.messages
        cpu_c0, cpu_s0 = time.process_time(), _proc_cpu_s(server_pid)
        t0 = clock()
        got = 0
        async for _item in client.stream(address, "bench/stream", {"n": n}):
            got += 1
        stream_s = clock() - t0
        cpu_c1, cpu_s1 = time.process_time(), _proc_cpu_s(server_pid)
        assert got == n, (got, n)

        per = n // args.concurrency

        async def one() -> int:
            k = 0
            async for _item in client.stream(address, "bench/stream", {"n": per}):
                k += 1
            return k

        t0 = clock()
        counts = await asyncio.gather(*(one() for _ in range(args.concurrency)))
        conc_s = clock() - t0
        assert sum(counts) == per * args.concurrency

        return {
            "rtt_p50_us": round(percentile_of_sorted(lat, 0.50) * 1e6, 1),
            "rtt_p99_us": round(percentile_of_sorted(lat, 0.99) * 1e6, 1),
            "rtt_mean_us": round(sum(lat) / len(lat) * 1e6, 1),
            "requests": args.requests,
            "stream_msgs_per_s": round(n / stream_s),
            "stream_messages": n,
            "cpu_us_per_msg_client": round((cpu_c1 - cpu_c0) / n * 1e6, 2),
            "cpu_us_per_msg_server": round((cpu_s1 - cpu_s0) / n * 1e6, 2),
            "concurrent_stream_msgs_per_s": round(per * args.concurrency / conc_s),
            "concurrency": args.concurrency,
        }
    finally:
        await client.close()


def _spawn_server(
    transport: str, nats_url: str | None, uvloop: bool
) -> tuple[subprocess.Popen[str], dict[str, str]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", transport]
    if nats_url:
        cmd += ["--nats-url", nats_url]
    if not uvloop:
        cmd.append("--no-uvloop")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{transport} bench server exited with {proc.wait()}")
    return proc, json.loads(line)


def _start_nats() -> tuple[subprocess.Popen[bytes], str, str] | None:
    binary = shutil.which("nats-server")
    if binary is None:
        return None
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="dynamod-bench-nats-")
    proc = subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port), "-l", os.path.join(tmp, "nats.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"nats://127.0.0.1:{port}", tmp
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError("nats-server did not start")


def _run(coro: Any, uvloop: bool) -> Any:
    if uvloop:
        try:
            import uvloop as _uvloop

            return _uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def _bench_one(transport: str, nats_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    from dynamod.shared.transport.plane import ServerAddress

    proc, addr = _spawn_server(transport, nats_url, args.uvloop)
    try:
        return _run(
            _measure(ServerAddress(addr["transport"], addr["address"]), nats_url, proc.pid, args), args.uvloop
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--transports", default="tcp,nats", help="comma-separated: tcp, nats [tcp,nats]")
    parser.add_argument("--requests", type=int, default=5000, help="sequential round trips [5000]")
    parser.add_argument("--messages", type=int, default=200_000, help="streamed responses per run [200000]")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent streams in the last run [16]")
    parser.add_argument("--no-uvloop", dest="uvloop", action="store_false", help="use the stock asyncio loop")
    parser.add_argument("--serve", choices=["tcp", "nats"], help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        _run(_serve(args.serve, args.nats_url), args.uvloop)
        return

    result: dict[str, Any] = {
        "loop": "uvloop" if args.uvloop else "asyncio",
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    for transport in [t.strip() for t in args.transports.split(",") if t.strip()]:
        if transport == "tcp":
            result["tcp"] = _bench_one("tcp", None, args)
        elif transport == "nats":
            started = _start_nats()
            if started is None:
                result["nats"] = {"skipped": "nats-server not found on PATH"}
                continue
            nats_proc, url, tmp = started
            try:
                result["nats"] = _bench_one("nats", url, args)
            finally:
                nats_proc.terminate()
                nats_proc.wait(10)
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise SystemExit(f"unknown transport {transport!r}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
