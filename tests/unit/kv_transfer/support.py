"""What the KV transfer tests share: backends to parametrize over, agent pairs, a peer process
and waiting for a condition with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest

from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.kv.transfer.factory import create_agent, nixl_unavailable_reason
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.peer import block_pattern, parse_ready_line, spawn_peer
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata


def _nixl_param() -> object:
    reason = nixl_unavailable_reason()
    return pytest.param(
        "nixl", marks=pytest.mark.skipif(reason is not None, reason=f"NIXL unusable: {reason}")
    )


BACKENDS = ["tcp", _nixl_param()]


async def eventually(predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    """Waits until ``predicate()`` is truthy; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


def fill(memory: KvBlockMemory, seed: int = 1) -> None:
    for block_id in range(memory.num_blocks):
        memory.array[block_id] = block_pattern(seed, block_id, memory.block_bytes)


async def started_agent(memory: KvBlockMemory, backend: str, worker_id: int) -> KvTransferAgent:
    agent = create_agent(memory, worker_id=worker_id, backend=backend)
    await agent.start()
    return agent


class PeerProcess:
    """A serving agent in a child process (``python -m dynamod.shared.kv.transfer.peer``)."""

    def __init__(
        self, backend: str, blocks: int, block_bytes: int, seed: int = 0, env: dict[str, str] | None = None
    ) -> None:
        self.seed = seed
        self.block_bytes = block_bytes
        self.proc = spawn_peer(backend, blocks, block_bytes, seed, env)
        self.metadata: KvTransferMetadata | None = None

    async def ready(self, timeout: float = 30.0) -> KvTransferMetadata:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise AssertionError(f"peer process exited with {self.proc.wait()} before it was ready")
        self.metadata = parse_ready_line(line)
        return self.metadata

    async def next_notification(self, timeout: float = 5.0) -> str:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        event = json.loads(line)
        assert event["event"] == "notify", line
        return event["message"]

    def expected(self, block_ids: list[int]) -> np.ndarray:
        return np.stack([block_pattern(self.seed, b, self.block_bytes) for b in block_ids])

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
