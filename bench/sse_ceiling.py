"""The Python ceiling: a minimal uvicorn (httptools, uvloop) SSE server that streams fixed chunks.

    python bench/sse_ceiling.py --port 8100 [--chunks 32] [--chunk-interval-ms 0]
    python bench/sse_ceiling.py --measure --concurrency 64 --requests 2000   # serve + load, JSON

It answers any POST with the same stream a chat completion would produce (``--chunks`` content
chunks, a usage chunk and ``[DONE]``), doing no tokenization, routing or request-plane work. The
frontend's throughput and CPU per request measured with ``bench/frontend_load.py`` against this
server is what plain Python + uvicorn can do; the gap to it is the frontend's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from bench_util import free_port

_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def make_app(chunks: int, interval_s: float) -> Any:
    created = int(time.time())
    body_chunks = []
    for i in range(chunks):
        obj = {
            "id": "chatcmpl-ceiling", "object": "chat.completion.chunk", "created": created, "model": "tiny",
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None if i < chunks - 1 else "length"}],
        }
        body_chunks.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
    usage = {
        "id": "chatcmpl-ceiling", "object": "chat.completion.chunk", "created": created, "model": "tiny", "choices": [],
        "usage": {"prompt_tokens": 200, "completion_tokens": chunks, "total_tokens": 200 + chunks},
    }
    tail = b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            body = json.dumps({"status": "healthy", "pid": os.getpid(), "frontend_pids": [os.getpid()]}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        for i, chunk in enumerate(body_chunks):
            if interval_s:
                await asyncio.sleep(interval_s)
            if i == len(body_chunks) - 1:
                await send({"type": "http.response.body", "body": chunk + tail, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

    return app


def serve(host: str, port: int, chunks: int, interval_s: float) -> None:
    import uvicorn

    uvicorn.run(
        make_app(chunks, interval_s), host=host, port=port, http="httptools", loop="uvloop",
        lifespan="off", access_log=False, log_level="warning", proxy_headers=False, server_header=False,
        backlog=4096,
    )


def measure(args: argparse.Namespace) -> int:
    """Starts the server in a subprocess, runs frontend_load.py against it, prints its JSON."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--port", str(port), "--chunks", str(args.chunks),
         "--chunk-interval-ms", str(args.chunk_interval_ms)],
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    print("ceiling server did not start", file=sys.stderr)
                    return 1
                time.sleep(0.1)
        load = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frontend_load.py")
        cmd = [sys.executable, load, "--url", f"http://127.0.0.1:{port}", "--concurrency", str(args.concurrency),
               "--requests", str(args.requests), "--max-tokens", str(args.chunks), "--json"]
        if args.both:
            cmd.append("--both")
        return subprocess.call(cmd)
    finally:
        server.terminate()
        server.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--chunk-interval-ms", type=float, default=0.0, help="pause between chunks (0: none)")
    p.add_argument("--measure", action="store_true", help="serve on a free port and run the load generator")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--both", action="store_true", help="with --measure: reused and fresh connections")
    args = p.parse_args()
    if args.measure:
        return measure(args)
    serve(args.host, args.port, args.chunks, args.chunk_interval_ms / 1000.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
