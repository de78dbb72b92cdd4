"""Real vLLM (CPU build) prefill and decode workers moving KV through vLLM's NixlConnector.

Two worker daemons on the tiny random-weight Llama: ``--role prefill`` (component ``prefill``) and
``--role decode`` (component ``backend``), each configured by the adapter with the NIXL connector
on host memory. The test plays the frontend's part of the contract over the request plane: a
prefill-only request to the prefill worker, the first frame's ``disaggregated_params`` passed as
they are to the decode worker, and the decode stream read to its end.

That the decode worker really used the prefill worker's blocks (and did not quietly recompute the
prompt) is checked by behaviour: with the blocks as sent, greedy decoding equals a local run of the
same prompt, token for token and log-probability for log-probability; with the block list permuted
the log-probabilities move (the random-weight model's greedy tokens barely depend on the context,
its probabilities do). The decode worker's prefix cache is
cleared before each run, so neither run can borrow the other's blocks.

Needs the vLLM environment with NIXL (scripts/setup_vllm_env.sh installs both); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions
from dynamod.shared.runtime.client import EndpointClient
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.integration.engines.test_vllm_support import (
    ENGINE_START_TIMEOUT_S,
    VllmCluster,
    build_tiny_model,
    nixl_importable,
    vllm_marks,
    vllm_python,
)

VLLM_PYTHON = vllm_python()
pytestmark = [
    *vllm_marks(VLLM_PYTHON),
    pytest.mark.skipif(VLLM_PYTHON is not None and not nixl_importable(VLLM_PYTHON),
                       reason="NIXL is not installed in the vLLM environment: run scripts/setup_vllm_env.sh"),
]

MODEL = "tinyllama"
BLOCK = 32
VLLM_ARGS = f"--block-size {BLOCK} --enforce-eager --max-model-len 2048"
PROMPT = [5 + (i * 37) % 1500 for i in range(100)]  # 3 full blocks and a partial one
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    assert VLLM_PYTHON is not None
    root = tmp_path_factory.mktemp("vllm-disagg")
    build_tiny_model(root / MODEL)
    c = VllmCluster(root, VLLM_PYTHON, root / MODEL)
    try:
        c.start_worker(VLLM_ARGS, role="prefill")
        c.start_worker(VLLM_ARGS, role="decode")
        yield c
    finally:
        c.stop()


class Pools:
    """The test's runtime with clients for the prefill and the decode pool."""

    def __init__(self, rt: DistributedRuntime, prefill: EndpointClient, decode: EndpointClient) -> None:
        self.rt = rt
        self.prefill = prefill
        self.decode = decode

    async def clear_decode_cache(self) -> None:
        [worker] = self.decode.routable
        client = await self.rt.namespace().component("backend").endpoint("clear_kv_blocks").client()
        try:
            await client.wait_for_instances(1, timeout=10, routable=False)
            [reply] = await client.call({}, instance_id=worker.instance_id)
            assert reply["status"] == "ok", reply
        finally:
            await client.close()

    async def stream(self, client: EndpointClient, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        body = msgspec.to_builtins(request)
        async for frame in client.generate(body, timeout_s=120):
            yield msgspec.convert(frame, EngineOutput)


async def _wait_ready(cluster: VllmCluster, clients: list[EndpointClient]) -> None:
    """Both workers registered (their engines started), or one died: fail with its log."""
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in cluster.workers:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
        if all(c.routable for c in clients):
            return
        await asyncio.sleep(0.5)
    raise AssertionError("vLLM prefill/decode workers did not register in time:\n"
                         + "\n".join(p.log() for p in cluster.workers))


@pytest.fixture
async def pools(cluster: VllmCluster) -> AsyncIterator[Pools]:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq",
                               lease_ttl_s=cluster.lease_ttl)
    rt = await DistributedRuntime.create(settings)
    prefill = await rt.namespace().component("prefill").endpoint("generate").client()
    decode = await rt.namespace().component("backend").endpoint("generate").client()
    try:
        await _wait_ready(cluster, [prefill, decode])
        yield Pools(rt, prefill, decode)
    finally:
        await prefill.close()
        await decode.close()
        await rt.shutdown(1)


def _request(rid: str, *, prefill_only: bool = False, params: dict[str, Any] | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model=MODEL,
        token_ids=list(PROMPT),
        sampling=SamplingOptions(temperature=0.0, logprobs=1),
        stop=StopConditions(max_tokens=1 if prefill_only else NEW_TOKENS, ignore_eos=not prefill_only),
        prefill_only=prefill_only,
        disaggregated_params=params,
    )


async def _prefill(pools: Pools, rid: str) -> dict[str, Any]:
    """The frontend's prefill stage: the first frame with parameters, then the rest drained."""
    params: dict[str, Any] | None = None
    frames = 0
    async for out in pools.stream(pools.prefill, _request(rid, prefill_only=True)):
        frames += 1
        if params is None and out.disaggregated_params:
            params = out.disaggregated_params
        assert out.finish_reason in (None, "stop", "length"), out
    assert params is not None, f"no frame of {frames} carried disaggregated_params"
    return params


class Decoded(msgspec.Struct):
    tokens: list[int]
    log_probs: list[float]
    reason: str | None


async def _decode(pools: Pools, rid: str, params: dict[str, Any] | None) -> Decoded:
    out_ = Decoded([], [], None)
    async for out in pools.stream(pools.decode, _request(rid, params=params)):
        out_.tokens += out.token_ids
        out_.log_probs += out.log_probs or []
        out_.reason = out.finish_reason or out_.reason
    assert out_.reason == "length" and len(out_.tokens) == NEW_TOKENS == len(out_.log_probs), out_
    return out_


async def test_decode_reads_the_prefill_workers_kv_over_nixl(pools: Pools) -> None:
    await pools.clear_decode_cache()
    params = await _prefill(pools, "pd-prefill-1")
    # vLLM's NixlConnector answer: where the blocks are and how to reach the engine holding them.
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"] and all(params["remote_block_ids"])
    assert isinstance(params["remote_engine_id"], str) and isinstance(params["remote_port"], int)
    assert params["remote_num_tokens"] == len(PROMPT)

    remote = await _decode(pools, "pd-decode-1", params)

    # The decode worker's own local prefill (the frontend's fallback) of the same prompt.
    await pools.clear_decode_cache()
    local = await _decode(pools, "pd-local-1", None)
    assert remote.tokens == local.tokens
    assert remote.log_probs == pytest.approx(local.log_probs, abs=1e-3), (remote, local)


async def test_decode_output_depends_on_the_transferred_blocks(pools: Pools) -> None:
    await pools.clear_decode_cache()
    local = await _decode(pools, "perm-local", None)
    await pools.clear_decode_cache()
    params = await _prefill(pools, "perm-prefill")
    groups = params["remote_block_ids"]
    # Read the same blocks in another order: same bytes moved, wrong positions.
    params["remote_block_ids"] = [list(reversed(group)) for group in groups]
    remote = await _decode(pools, "perm-decode", params)
    moved = max(abs(a - b) for a, b in zip(remote.log_probs, local.log_probs, strict=True))
    assert moved > 1e-2, f"permuted KV blocks left the output as computed locally: {remote} vs {local}"
