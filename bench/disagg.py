"""Disaggregated serving benchmark. Prints one JSON object, one key per section.

    python bench/disagg.py [--sections transfer] [--backends tcp,nixl] [--blocks 1,16,256]
                           [--block-bytes 2097152] [--iterations 20]

``transfer``: KV block reads between two processes. A serving agent runs in a child process
(``dynamod.shared.kv.transfer.peer``, blocks filled with seeded bytes); this process reads ``n``
blocks from it ``--iterations`` times per (backend, n) after one warm-up read, and reports
latency p50/p99 (ms), throughput (GB/s, bytes of one read over its p50 time, and over the mean)
and the block size. Every configuration's first read is verified against the bytes the peer holds
(``checksum_ok``). The default block is a Llama-3-8B-like one: 32 layers x 8 KV heads x 128 head
dim x 2 (K and V) x 2 bytes x 16 tokens = 2 MiB. NIXL runs only where it is usable (else its
entry says why); UCX transports follow ``UCX_TLS`` (defaults: shared memory and TCP on one host).

``serving`` (``bench/disagg_serving.py``): aggregated vs disaggregated clusters of real processes
at the same total worker count under a mixed load (long prompts among short-prompt, long-output
streams), TTFT and ITL p50/p99 per request class:

    python bench/disagg.py --sections serving [--topologies agg:4,disagg:1:3,disagg:2:2]
                           [--serving-kv-transfer-overlap chunk|none]

Disaggregated topologies also report the exposed KV transfer (prefill end to the decode worker
holding every block) from the decode workers' metrics: with ``chunk`` (the default) the decode
worker reads each prefill chunk's blocks while the next one computes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynamod.shared.kv.transfer.factory import create_agent, nixl_unavailable_reason  # noqa: E402
from dynamod.shared.kv.transfer.memory import KvBlockMemory  # noqa: E402
from dynamod.shared.kv.transfer.peer import block_pattern, parse_ready_line, spawn_peer  # noqa: E402
from dynamod.shared.protocol.kv_transfer import KvLayout  # noqa: E402
from dynamod.shared.stats import percentiles  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from disagg_serving import add_serving_args, serving_section  # noqa: E402

LLAMA3_8B_BLOCK = KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16)


class _Peer:
    """The serving agent's process; closing its stdin ends it."""

    def __init__(self, backend: str, blocks: int, block_bytes: int, seed: int) -> None:
        self.proc = spawn_peer(backend, blocks, block_bytes, seed)

    def ready(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the serving agent exited with {self.proc.wait()} before it was ready")
        return parse_ready_line(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


async def bench_backend(
    backend: str, counts: list[int], block_bytes: int, iterations: int, seed: int = 7
) -> list[dict]:
    """Reads of each size in ``counts`` from a peer process over ``backend``."""
    blocks = max(counts)
    peer = _Peer(backend, blocks, block_bytes, seed)
    reader = None
    try:
        meta = await asyncio.to_thread(peer.ready)
        reader = create_agent(KvBlockMemory(blocks, block_bytes), worker_id=0xBE, backend=backend)
        await reader.start()
        rows = []
        for n in counts:
            ids = list(range(n))
            reader.memory.array[:n] = 0
            await reader.read_blocks(meta, ids, ids, timeout_s=120, notify="warm-up")
            checksum_ok = all(
                np.array_equal(reader.memory.array[b], block_pattern(seed, b, block_bytes)) for b in ids
            )
            seconds = []
            for i in range(iterations):
                result = await reader.read_blocks(meta, ids, ids, timeout_s=120, notify=f"bench-{n}-{i}")
                seconds.append(result.seconds)
            num_bytes = n * block_bytes
            p50, p99 = percentiles(seconds, (0.5, 0.99))
            rows.append(
                {
                    "backend": backend,
                    "blocks": n,
                    "block_bytes": block_bytes,
                    "bytes": num_bytes,
                    "iterations": iterations,
                    "latency_ms_p50": round(p50 * 1e3, 3),
                    "latency_ms_p99": round(p99 * 1e3, 3),
                    "throughput_gbps_p50": round(num_bytes / p50 / 1e9, 3),
                    "throughput_gbps_mean": round(num_bytes * len(seconds) / sum(seconds) / 1e9, 3),
                    "checksum_ok": checksum_ok,
                }
            )
        return rows
    finally:
        if reader is not None:
            await reader.close()
        await asyncio.to_thread(peer.close)


async def transfer_section(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(c) for c in args.blocks.split(",")]
    out: dict[str, Any] = {
        "block_bytes": args.block_bytes,
        "iterations": args.iterations,
        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
        "results": [],
        "skipped": {},
    }
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend == "nixl":
            reason = nixl_unavailable_reason()
            if reason is not None:
                out["skipped"][backend] = reason
                continue
        out["results"].extend(await bench_backend(backend, counts, args.block_bytes, args.iterations))
    return out


SECTIONS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]]] = {
    "transfer": transfer_section,
    "serving": serving_section,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections",
        default="transfer",
        help=f"comma-separated, of: {', '.join(SECTIONS)} [default transfer]",
    )
    g = parser.add_argument_group("transfer")
    g.add_argument("--backends", default="tcp,nixl", help="transfer backends [default tcp,nixl]")
    g.add_argument("--blocks", default="1,16,256", help="blocks per read [default 1,16,256]")
    g.add_argument(
        "--block-bytes",
        type=int,
        default=LLAMA3_8B_BLOCK.block_bytes,
        help=f"bytes per block [default {LLAMA3_8B_BLOCK.block_bytes}: Llama-3-8B, 16 tokens, bf16]",
    )
    g.add_argument("--iterations", type=int, default=20, help="timed reads per configuration [default 20]")
    add_serving_args(parser)
    return parser


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    started = time.monotonic()
    out: dict[str, Any] = {}
    for name in names:
        out[name] = await SECTIONS[name](args)
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
