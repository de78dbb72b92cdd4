"""A standalone serving agent in its own process, for the transfer benchmark and tests.

``python -m dynamod.shared.kv.transfer.peer --backend tcp --blocks 256 --block-bytes 2097152``
fills its blocks with bytes derived from ``--seed`` (block ``i`` from seed ``(seed, i)``, so a reader
can recompute any block without the others), starts an agent, and prints one JSON line per event
on stdout (anything else a library prints there is moved to stderr):
``{"event": "ready", "metadata": ...}`` (``KvTransferMetadata`` as in discovery), then
``{"event": "notify", "message": ...}`` for every notification. It exits when stdin closes, so a
parent that dies takes it along.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

import numpy as np

from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_transfer import (
    KvTransferMetadata,
    decode_transfer_metadata,
    encode_transfer_metadata,
)


def spawn_peer(
    backend: str, blocks: int, block_bytes: int, seed: int = 0, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Starts a peer process (stdin, stdout: text pipes; stderr discarded). Read its ready line
    with ``parse_ready_line(proc.stdout.readline())``; close its stdin to end it."""
    argv = [sys.executable, "-m", "dynamod.shared.kv.transfer.peer", "--backend", backend, "--blocks", str(blocks),
            "--block-bytes", str(block_bytes), "--seed", str(seed)]
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})}, text=True,
    )


def block_pattern(seed: int, block_id: int, block_bytes: int) -> np.ndarray:
    """The bytes block ``block_id`` of a peer started with ``seed`` holds."""
    return np.random.default_rng((seed, block_id)).integers(0, 256, block_bytes, dtype=np.uint8)


def fill_blocks(memory: KvBlockMemory, seed: int, num_blocks: int) -> None:
    for block_id in range(min(num_blocks, memory.num_blocks)):
        memory.array[block_id] = block_pattern(seed, block_id, memory.block_bytes)


def ready_line(metadata: KvTransferMetadata) -> str:
    return json.dumps({"event": "ready", "metadata": json.loads(encode_transfer_metadata(metadata))})


def parse_ready_line(line: str) -> KvTransferMetadata:
    """The metadata of a peer's ``ready`` line; ValueError for any other line."""
    event = json.loads(line)
    if event.get("event") != "ready":
        raise ValueError(f"expected the peer's ready line, got {line!r}")
    return decode_transfer_metadata(json.dumps(event["metadata"]).encode())


def _events_channel():
    """A private copy of stdout for the event lines; fd 1 itself goes to stderr, because NIXL's
    and UCX's native loggers write to stdout and would interleave with the events."""
    events = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return events


async def serve(args: argparse.Namespace) -> None:
    from dynamod.shared.kv.transfer.factory import create_agent

    events = _events_channel()

    memory = KvBlockMemory(args.blocks, args.block_bytes)
    fill_blocks(memory, args.seed, args.fill if args.fill is not None else args.blocks)
    agent = create_agent(
        memory, worker_id=args.worker_id, backend=args.backend, host=args.host, port=args.port
    )

    def on_notify(message: str) -> None:
        print(json.dumps({"event": "notify", "message": message}), file=events, flush=True)

    agent.set_notify_callback(on_notify)
    await agent.start()
    loop = asyncio.get_running_loop()
    stdin_closed = loop.create_future()

    def on_stdin() -> None:
        if not os.read(sys.stdin.fileno(), 4096) and not stdin_closed.done():
            stdin_closed.set_result(None)

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    print(ready_line(agent.metadata()), file=events, flush=True)
    try:
        await stdin_closed
    finally:
        loop.remove_reader(sys.stdin.fileno())
        await agent.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="tcp", help="auto|nixl|tcp [default tcp]")
    parser.add_argument("--blocks", type=int, default=256, help="blocks of memory [default 256]")
    parser.add_argument("--block-bytes", type=int, default=4096, help="bytes per block [default 4096]")
    parser.add_argument(
        "--fill", type=int, default=None, help="blocks to fill with the seed's bytes [default all]"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the block contents [default 0]")
    parser.add_argument(
        "--worker-id", type=lambda v: int(v, 0), default=0x7EE7, help="worker id [default 0x7ee7]"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind host [default 127.0.0.1]")
    parser.add_argument("--port", type=int, default=0, help="TCP port [default: any free one]")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
