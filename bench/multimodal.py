"""Multimodal serving, aggregated (the workers encode images) against E+PD (an encode pool does):
TTFT with 0, 1 and 4 images per request, images seen for the first time ("miss") against the
same images again ("hit").

Runs real processes (a frontend and ``--workers`` mocker workers serving the built-in ``tiny-vl``
model on file discovery, as ``dynamod up`` would) and streams chat requests with data-URL images
through the OpenAI API. Per scenario it reports TTFT p50/p99 in wall milliseconds, the prompt and
cached tokens the server reported, and the requests' success count:

- ``text``: the same question without images (the baseline);
- ``1img_miss`` / ``4img_miss``: every request carries new images (each is decoded by the
  frontend, encoded by the worker's vision encoder and prefilled);
- ``1img_hit`` / ``4img_hit``: every request repeats the same images and text after one warm-up
  request: the frontend's decoded-image cache and the worker's prefix cache (blocks keyed by the
  images' content) skip the decode, the encoder and the prefill of everything but the last block.

The mocker's encoder costs ``--encode-ms-per-image-token`` per image token; ``--speedup`` divides
all simulated times. ``--topology epd`` adds ``--encode-workers`` encode workers (``dynamod --role
encode``, the same cost per image token): the frontend sends them the images and the agg workers
read the embeddings over the TCP block transport instead of encoding in their engine step;
``both`` runs the two clusters one after the other with the same requests. Prints one JSON object.

    python bench/multimodal.py [--requests 30] [--concurrency 2] [--image-size 448] [--topology both]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from bench_util import free_port, get_json, percentile, stop_processes
from PIL import Image

from dynamod.shared.cli_parser import ArgumentParser

CLI = [sys.executable, "-m", "dynamod.daemon.cli"]
MODEL = "tiny-vl"
QUESTION = "Look at the pictures and describe what they have in common in two short sentences."


def image_url(seed: int, size: int) -> str:
    """A distinct PNG per seed: 16x16 random colour cells scaled up (small file, real pixels)."""
    rng = random.Random(seed)
    cells = Image.frombytes("RGB", (16, 16), bytes(rng.getrandbits(8) for _ in range(16 * 16 * 3)))
    buf = io.BytesIO()
    cells.resize((size, size), Image.Resampling.NEAREST).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(urls: list[str]) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Streams one request; TTFT at the first content chunk, usage from the last."""
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                ttft = time.perf_counter() - start
            if obj.get("usage"):
                usage = obj["usage"]
    if ttft is None:
        raise RuntimeError("no content in the stream")
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def scenario(base: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:

        async def run(body: dict[str, Any]) -> None:
            async with sem:
                try:
                    results.append(await one(client, base + "/v1/chat/completions", body))
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    errors.append(str(exc)[:200])

        await asyncio.gather(*(run(b) for b in bodies))
    ttfts = sorted(r["ttft_s"] * 1000.0 for r in results)
    n = max(1, len(results))
    return {
        "requests": len(bodies), "ok": len(results), "errors": errors[:3],
        "ttft_ms_p50": round(percentile(ttfts, 0.5), 2) if ttfts else None,
        "ttft_ms_p99": round(percentile(ttfts, 0.99), 2) if ttfts else None,
        "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in results) / n, 1),
        "cached_tokens_mean": round(sum(r["cached_tokens"] for r in results) / n, 1),
    }


def start_cluster(root: Path, args: argparse.Namespace, encode_workers: int = 0) -> tuple[list[subprocess.Popen[bytes]], str]:
    kv = root / "discovery"
    kv.mkdir()
    flags = ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", str(kv)]
    procs = []
    logs = root / "logs"
    logs.mkdir()
    for i in range(args.workers):
        worker = [*CLI, "--role", "agg", "--engine", "mocker", "--model", MODEL, *flags, "--speedup-ratio", str(args.speedup),
                  "--block-size", str(args.block_size), "--encode-ms-per-image-token", str(args.encode_ms_per_image_token)]
        procs.append(subprocess.Popen(worker, stdout=open(logs / f"worker{i}.log", "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115
    for i in range(encode_workers):
        encoder = [*CLI, "--role", "encode", "--model", MODEL, *flags, "--speedup-ratio", str(args.speedup),
                   "--encode-ms-per-image-token", str(args.encode_ms_per_image_token), "--kv-transfer-backend", "tcp"]
        procs.append(subprocess.Popen(encoder, stdout=open(logs / f"encoder{i}.log", "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115
    port = free_port()
    frontend = [*CLI, "--role", "frontend", *flags, "--http-port", str(port), "--router-mode", "kv"]
    procs.append(subprocess.Popen(frontend, stdout=open(logs / "frontend.log", "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = get_json(base + "/health")
        models = {m["model"]: m for m in (health or {}).get("models", [])}
        encoders = sum(1 for i in (health or {}).get("instances", []) if i.get("endpoint") == "encode" and i.get("status") == "ready")
        if MODEL in models and sum(w["status"] == "ready" for w in models[MODEL]["workers"]) >= args.workers \
                and encoders >= encode_workers:
            return procs, base
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    stop_processes(procs, 5)
    raise SystemExit(f"cluster did not become ready; logs in {logs}")


async def run_all(base: str, args: argparse.Namespace) -> dict[str, Any]:
    size, n = args.image_size, args.requests
    seeds = iter(range(1, 1_000_000))
    out: dict[str, Any] = {}
    out["text"] = await scenario(base, [chat_body([]) for _ in range(n)], args.concurrency)
    for k in (1, 4):
        fresh = [chat_body([image_url(next(seeds), size) for _ in range(k)]) for _ in range(n)]
        out[f"{k}img_miss"] = await scenario(base, fresh, args.concurrency)
        same = chat_body([image_url(next(seeds), size) for _ in range(k)])
        await scenario(base, [same], 1)  # warm-up: decoded, encoded and cached once
        out[f"{k}img_hit"] = await scenario(base, [same] * n, args.concurrency)
    return out


def encode_paths(base: str) -> dict[str, float]:
    """Where the frontend says the images were encoded (``dynamo_frontend_encode_images_total``):
    remote (an encode worker), local (the agg worker), cached (nowhere), fallback."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^dynamo_frontend_encode_images_total\{[^}]*path="(\w+)"[^}]*\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30, help="requests per scenario [default 30]")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight [default 2]")
    parser.add_argument("--workers", type=int, default=1, help="aggregated mocker workers [default 1]")
    parser.add_argument("--image-size", type=int, default=448, help="square images, px (448 -> 256 tokens) [default 448]")
    parser.add_argument("--block-size", type=int, default=16, help="[default 16]")
    parser.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio [default 1]")
    parser.add_argument("--encode-ms-per-image-token", type=float, default=0.05, help="[default 0.05]")
    parser.add_argument("--topology", choices=("agg", "epd", "both"), default="agg",
                        help="agg: the workers encode; epd: an encode pool does; both: one then the other [default agg]")
    parser.add_argument("--encode-workers", type=int, default=1, help="encode workers of the epd topology [default 1]")
    args = parser.parse_args(argv)
    runs = {"agg": 0, "epd": args.encode_workers}
    chosen = list(runs) if args.topology == "both" else [args.topology]
    by_topology: dict[str, Any] = {}
    for name in chosen:
        root = Path(tempfile.mkdtemp(prefix="dynamod-bench-mm-"))
        procs, base = start_cluster(root, args, runs[name])
        try:
            results = asyncio.run(run_all(base, args))
            paths = encode_paths(base)
        finally:
            stop_processes(procs, 10)
        shutil.rmtree(root, ignore_errors=True)
        label = f"agg:{args.workers}" if name == "agg" else f"encode:{runs[name]}+agg:{args.workers}"
        by_topology[name] = {"topology": label, "images_encoded_by": paths, "scenarios": results}
    common = {
        "bench": "multimodal", "model": MODEL, "image_px": args.image_size,
        "requests_per_scenario": args.requests, "concurrency": args.concurrency, "speedup": args.speedup,
        "encode_ms_per_image_token": args.encode_ms_per_image_token,
    }
    if len(by_topology) == 1:
        print(json.dumps({**common, **next(iter(by_topology.values()))}, indent=2))
    else:
        print(json.dumps({**common, "topologies": by_topology}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
