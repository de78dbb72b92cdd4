"""Load generator for the OpenAI frontend: streaming chat completions at fixed concurrency.

    python bench/frontend_load.py --url http://127.0.0.1:8000 --model tiny --concurrency 64 \
        --requests 2000 --max-tokens 32 --prompt-tokens 200 [--fresh-connections | --both] --json

Reports requests/s, output tokens/s, TTFT and ITL (p50/p99), errors, and the CPU time the
frontend process(es) spent per request, read from /proc (pids from the frontend's ``/health``
``frontend_pids`` field, plus their child processes, or ``--frontend-pid``), with the frontend's
router mode (from ``/health``) so runs against an rr and a kv cluster can be told apart.
``--shared-prefixes 8`` gives the prompts 8 common prefixes (the issue-14 load).

The client is a small HTTP/1.1 implementation on asyncio streams with uvloop rather than httpx or
the openai client: on a shared machine the load generator's own CPU would otherwise be the
bottleneck. ``--both`` runs with reused keep-alive connections and then with a fresh connection
per request: with Nagle's algorithm on, the SSE chunks of a fresh connection would trail by the
peer's delayed-ACK time (~40 ms on Linux). After the load a few lone streams (``nagle_probe``)
measure ITL where each token is its own write; ``nagle_suspected`` is set when their median gap
reaches 30 ms.

On a shared machine the frontend's CPU per request moves with how fast the cores run Python at
the moment (other processes, cache pressure): ``calibration_ns_per_dict_insert``
(``bench_util.calibrate``, before and after the runs) says how fast that was, to compare runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import calibrate, percentile  # noqa: E402

_CLK_TCK = os.sysconf("SC_CLK_TCK")
NAGLE_SUSPECT_MS = 30.0


# ------------------------------------------------------------------------------------------------
# Prompts.


def make_prompts(count: int, prompt_tokens: int, seed: int, shared_prefixes: int = 0) -> list[str]:
    """Distinct prompts of about ``prompt_tokens`` tokens each (measured with the tiny tokenizer when
    available, else ~1 token per word). With ``shared_prefixes`` N > 0, the first half of each prompt
    is one of N common prefixes (system-prompt-like traffic, so KV mode has something to find);
    otherwise the prompts share nothing and the run measures routing, not cache hits."""
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "light", "green", "house", "table", "cloud", "music", "paper",
             "north", "quiet", "bread", "glass", "horse", "field", "dream", "water", "tower", "smile"]
    measure = None
    try:
        from dynamod.daemon.frontend.preprocess import Tokenizer
        from dynamod.daemon.models import TINY_MODEL_DIR

        tok = Tokenizer.from_dir(TINY_MODEL_DIR)

        def measure(text: str) -> int:
            return len(tok.encode(text))
    except Exception:  # noqa: BLE001 - the bench also runs without dynamod installed
        measure = None
    # Calibrate words per token once on a sample.
    sample = " ".join(rng.choice(words) for _ in range(400))
    per_word = (measure(sample) / 400) if measure else 1.0
    n_words = max(1, round(prompt_tokens / per_word)) - 8  # the chat template adds ~8 tokens
    prefix_words = n_words // 2 if shared_prefixes > 0 else 0
    prefixes = [
        f"prefix {k} " + " ".join(rng.choice(words) for _ in range(max(0, prefix_words - 2)))
        for k in range(max(1, shared_prefixes))
    ]
    prompts = []
    for i in range(count):
        body = " ".join(rng.choice(words) for _ in range(max(1, n_words - prefix_words)))
        if shared_prefixes > 0:
            prompts.append(f"{prefixes[i % shared_prefixes]} {i} {body}")
        else:
            prompts.append(f"{i} {body}")
    return prompts


# ------------------------------------------------------------------------------------------------
# A lean HTTP/1.1 client for SSE.


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


class HttpError(Exception):
    pass


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def ensure(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.reader = None


_decode = msgspec.json.decode


async def stream_request(conn: Connection, path: str, body: bytes, keep_alive: bool, request_id: str | None = None) -> Result:
    await conn.ensure()
    assert conn.reader is not None and conn.writer is not None
    rid = f"x-request-id: {request_id}\r\n" if request_id is not None else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {conn.host}:{conn.port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n{rid}"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    conn.writer.write(head + body)
    reader = conn.reader
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("connection closed before the response")
    status = int(status_line.split(b" ", 2)[1])
    chunked = False
    length = None
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        lower = line.lower()
        if lower.startswith(b"transfer-encoding:") and b"chunked" in lower:
            chunked = True
        elif lower.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if status != 200:
        text = await reader.readexactly(length) if length is not None else b""
        raise HttpError(f"HTTP {status}: {text[:200].decode(errors='replace')}")
    if not chunked:
        data = await reader.readexactly(length or 0)
        raise HttpError(f"expected a stream, got {data[:200]!r}")
    result = Result(ok=True)
    buffer = b""
    last = None
    done = False
    while True:  # to the terminating zero-size chunk, so a kept-alive connection stays in sync
        size_line = await reader.readline()
        size = int(size_line.strip(), 16)
        if size == 0:
            await reader.readline()
            break
        data = await reader.readexactly(size + 2)
        now = time.perf_counter()
        buffer += data[:-2]
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                done = True
                continue
            obj = _decode(payload)
            if "error" in obj:
                raise HttpError(f"in-stream error: {obj['error'].get('message')}")
            choices = obj.get("choices") or []
            if choices:
                content = choices[0].get("delta", {}).get("content") or choices[0].get("text")
                if content:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
            usage = obj.get("usage")
            if usage:
                result.tokens = usage.get("completion_tokens", 0)
    if not done:
        raise HttpError("the stream ended without [DONE]")
    if not keep_alive:
        conn.close()
    return result


# ------------------------------------------------------------------------------------------------
# Frontend CPU.


def frontend_pids(base_url: str, explicit: list[int]) -> list[int]:
    pids = set(explicit)
    if not pids:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
                body = json.loads(resp.read())
            pids.update(body.get("frontend_pids") or [body["pid"]])
        except (OSError, ValueError, KeyError):
            pass
    # Child processes of the frontend (e.g. --num-frontends copies) count too.
    for pid in list(pids):
        pids.update(_descendants(pid))
    return sorted(p for p in pids if os.path.exists(f"/proc/{p}"))


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out.append(int(child))
                    out.extend(_descendants(int(child)))
    except OSError:
        pass
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return total / _CLK_TCK


# ------------------------------------------------------------------------------------------------
# The run.


async def run_load(args: argparse.Namespace, fresh: bool, prompts: list[str]) -> dict:
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    bodies = []
    for prompt in prompts:
        req: dict = {
            "model": args.model, "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        }
        if args.endpoint == "chat":
            req["messages"] = [{"role": "user", "content": prompt}]
        else:
            req["prompt"] = prompt
        bodies.append(json.dumps(req).encode())
    results: list[Result] = []
    errors: dict[str, int] = {}
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        conn = Connection(host, port)
        while next_index < len(bodies):
            body = bodies[next_index]
            rid = f"{args.request_ids}-{next_index}" if args.request_ids else None
            next_index += 1
            try:
                results.append(await stream_request(conn, path, body, keep_alive=not fresh, request_id=rid))
            except (HttpError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                key = str(exc)[:160]
                errors[key] = errors.get(key, 0) + 1
                results.append(Result(ok=False, error=key))
                conn.close()
            if fresh:
                conn.close()
        conn.close()

    pids = frontend_pids(args.url.rstrip("/"), args.frontend_pid or [])
    cpu0 = cpu_seconds(pids)
    client0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    client1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu1 = cpu_seconds(pids)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    itls = [x * 1000 for r in ok for x in r.itls]
    tokens = sum(r.tokens for r in ok)
    wrong_count = sum(1 for r in ok if r.tokens != args.max_tokens)
    return {
        "connections": "fresh" if fresh else "reused",
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "wrong_token_count": wrong_count,
        "duration_s": round(elapsed, 3),
        "req_per_s": round(len(ok) / elapsed, 1),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "ttft_ms": {"p50": round(percentile(ttfts, 0.5), 2), "p99": round(percentile(ttfts, 0.99), 2),
                    "mean": round(statistics.fmean(ttfts), 2) if ttfts else 0.0},
        "itl_ms": {"p50": round(percentile(itls, 0.5), 3), "p99": round(percentile(itls, 0.99), 3),
                   "mean": round(statistics.fmean(itls), 3) if itls else 0.0},
        "frontend_pids": pids,
        "frontend_cpu_s": round(cpu1 - cpu0, 3),
        "frontend_cpu_ms_per_req": round((cpu1 - cpu0) * 1000 / max(1, len(ok)), 3) if pids else None,
        "client_cpu_s": round(
            (client1.ru_utime - client0.ru_utime) + (client1.ru_stime - client0.ru_stime), 3
        ),
    }


async def main_async(args: argparse.Namespace) -> dict:
    calibration_before = calibrate()
    prompts = make_prompts(args.requests + args.warmup, args.prompt_tokens, args.seed, args.shared_prefixes)
    if args.warmup:
        saved = args.requests
        await run_load(args, False, prompts[: args.warmup])
        args.requests = saved
    prompts = prompts[args.warmup :]
    modes = [False, True] if args.both else [args.fresh_connections]
    runs = [await run_load(args, fresh, prompts) for fresh in modes]
    report = {
        "url": args.url, "model": args.model, "endpoint": args.endpoint, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
        "shared_prefixes": args.shared_prefixes, "router_mode": _router_mode(args.url.rstrip("/")), "runs": runs,
    }
    # Under load the frontend sends the tokens that queued up for a stream in one write, so the
    # loaded runs' ITL says little about Nagle. A few lone streams on fresh connections do: each
    # token is its own small write, and a held-back segment shows as a ~40 ms gap on most tokens.
    probe_args = argparse.Namespace(**{**vars(args), "concurrency": 1})
    probe = await run_load(probe_args, True, prompts[: args.nagle_probe_requests])
    report["nagle_probe"] = {"requests": probe["ok"], "itl_ms": probe["itl_ms"]}
    report["nagle_suspected"] = probe["itl_ms"]["p50"] >= NAGLE_SUSPECT_MS or any(
        r["itl_ms"]["p50"] >= NAGLE_SUSPECT_MS for r in runs
    )
    report["calibration_ns_per_dict_insert"] = {"before": calibration_before, "after": calibrate()}
    return report


def _router_mode(base_url: str) -> str | None:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
            return json.loads(resp.read()).get("router_mode")
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--warmup", type=int, default=64, help="requests sent first and not measured")
    p.add_argument("--fresh-connections", action="store_true", help="a new TCP connection per request")
    p.add_argument("--both", action="store_true", help="run with reused, then with fresh connections")
    p.add_argument("--nagle-probe-requests", type=int, default=4,
                   help="lone streams (concurrency 1, fresh connections) sent after the load to look for Nagle stalls")
    p.add_argument("--frontend-pid", type=int, action="append", help="frontend pid(s) for CPU accounting")
    p.add_argument("--shared-prefixes", type=int, default=0,
                   help="N common prompt prefixes (half of each prompt) [default 0: all distinct]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-ids", default="", metavar="PREFIX",
                   help="send x-request-id PREFIX-N with request N (the client-chosen id path) [default: none]")
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    args = p.parse_args(argv)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    report = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0 if all(r["errors"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
