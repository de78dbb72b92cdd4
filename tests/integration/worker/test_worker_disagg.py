"""Disaggregated serving between real worker processes: a ``--role prefill`` and a ``--role decode``
mocker daemon on file discovery, moving the prompt's KV bytes over the transfer agent.

The test plays the frontend's part by hand (prefill-only request, then the decode request with the
prefill worker's parameters) so that what the workers promise is checked on its own: the decode
stream completes, the bytes it received are the bytes the prefill computed (checksum), held
blocks are freed by the decode's notification or by the hold timeout, and a prefill worker killed
before the read leaves the decode to prefill locally.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.kv.transfer.factory import nixl_available, nixl_unavailable_reason
from dynamod.shared.protocol.keys import kv_transfer_key, mdc_key
from dynamod.shared.protocol.kv_transfer import KvTransferParams, decode_transfer_metadata
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, StopConditions
from dynamod.shared.protocol.load import LoadMetrics, load_decoder
from dynamod.shared.protocol.model_card import decode_card
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.daemons import DaemonProcess, file_cluster_env
from tests.integration.worker.test_worker_daemon import run_generate, wait_registered

BLOCK = 16
TTL = 2.0
# tiny: 2 layers x 2 KV heads x 16 head dim x 2 (K, V) x 4 bytes (float32) x 16 tokens
BLOCK_BYTES = 2 * 2 * 16 * 2 * 4 * BLOCK


def worker_args(role: str, *extra: str, backend: str = "tcp") -> list[str]:
    return ["--role", role, "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "20",
            "--block-size", str(BLOCK), "--num-gpu-blocks", "256", "--kv-transfer-backend", backend, *extra]


class Disagg:
    """Daemons started by a test plus an in-test runtime on their discovery directory."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.kv_dir = tmp_path / "kv"
        self.env = file_cluster_env(self.kv_dir, DYN_LEASE_TTL=str(TTL))
        self.daemons: list[DaemonProcess] = []
        self.rt: DistributedRuntime | None = None

    async def start(self) -> None:
        settings = RuntimeSettings(discovery_backend="file", file_kv=str(self.kv_dir), event_plane="zmq", lease_ttl_s=TTL)
        self.rt = await DistributedRuntime.create(settings)

    async def worker(self, role: str, *extra: str, backend: str = "tcp"):
        """Starts a worker and waits for its ``generate`` instance; returns (daemon, client, instance)."""
        assert self.rt is not None
        daemon = DaemonProcess(worker_args(role, *extra, backend=backend), env=self.env, log_dir=str(self.tmp_path))
        self.daemons.append(daemon)
        component = "prefill" if role == "prefill" else "backend"
        client = await self.rt.namespace().component(component).endpoint("generate").client()
        [inst] = await wait_registered(client, daemon)
        return daemon, client, inst

    async def close(self) -> None:
        for daemon in self.daemons:
            daemon.kill()
        if self.rt is not None:
            await self.rt.shutdown(1)


@pytest.fixture
async def disagg(tmp_path):
    cluster = Disagg(tmp_path)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.close()


def prefill_request(rid: str, tokens: list[int]) -> dict:
    return msgspec.to_builtins(PreprocessedRequest(
        request_id=rid, model="tiny", token_ids=tokens, prefill_only=True, stop=StopConditions(max_tokens=1),
    ))


def decode_request(rid: str, tokens: list[int], params: dict, max_tokens: int = 12) -> dict:
    return msgspec.to_builtins(PreprocessedRequest(
        request_id=rid, model="tiny", token_ids=tokens, disaggregated_params=params,
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    ))


async def load_until(sub_iter, worker_id: int, predicate: Callable[[LoadMetrics], bool], timeout: float = 10.0) -> LoadMetrics:
    """The first load report of ``worker_id`` that satisfies ``predicate`` (reports come at least
    once a second, so a late subscriber still sees the current state)."""
    async with asyncio.timeout(timeout):
        while True:
            m = load_decoder.decode((await anext(sub_iter)).payload)
            if m.worker_id == worker_id and predicate(m):
                return m


async def prefill(client, inst, rid: str, tokens: list[int]) -> tuple[list[EngineOutput], KvTransferParams]:
    outs = await run_generate(client, inst, prefill_request(rid, tokens))
    assert outs[-1].finish_reason is not None and outs[-1].disaggregated_params is not None
    return outs, msgspec.convert(outs[-1].disaggregated_params, KvTransferParams)


@pytest.fixture(params=["tcp", "nixl"])
def backend(request) -> str:
    if request.param == "nixl" and not nixl_available():
        pytest.skip(f"NIXL is not usable here: {nixl_unavailable_reason()}")
    return request.param


async def test_decode_receives_the_bytes_the_prefill_computed_and_the_hold_is_freed(disagg, backend) -> None:
    p_daemon, p_client, p_inst = await disagg.worker("prefill", backend=backend)
    d_daemon, d_client, d_inst = await disagg.worker("decode", backend=backend)
    rt = disagg.rt
    # Both agents are in discovery before their generate endpoints were served.
    for component, inst in (("prefill", p_inst), ("backend", d_inst)):
        meta = decode_transfer_metadata(await rt.store.get(kv_transfer_key("dynamo", component, inst.instance_id)))
        assert meta.block_bytes == BLOCK_BYTES and meta.backend == backend and meta.num_blocks == 256
    card = decode_card(await rt.store.get(mdc_key("dynamo", "backend", "generate", d_inst.instance_id)))
    assert sorted(card.model_types) == ["chat", "completions"]
    card = decode_card(await rt.store.get(mdc_key("dynamo", "prefill", "generate", p_inst.instance_id)))
    assert card.model_types == ["prefill"]

    sub = await rt.namespace().component("prefill").subscribe("kv_metrics")
    loads = sub.__aiter__()
    prompt = list(range(100, 100 + 4 * BLOCK + 5))  # four full blocks and a partial one
    _, params = await prefill(p_client, p_inst, "req-1", prompt)
    assert params.worker_id == p_inst.instance_id and len(params.block_ids) == 5 and len(params.block_hashes) == 4
    assert params.num_tokens == len(prompt) and params.checksum is not None and params.first_token is not None
    await load_until(loads, p_inst.instance_id, lambda m: m.kv_held_blocks == 5)

    outs = await run_generate(d_client, d_inst, decode_request("req-1", prompt, msgspec.to_builtins(params)))
    assert sum(len(o.token_ids) for o in outs) == 12 and outs[-1].finish_reason == "length"
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert report["ok"] is True, report
    assert report["checksum"] == report["expected"] == params.checksum
    assert report["blocks"] == 5 and report["bytes"] == 5 * BLOCK_BYTES and report["backend"] == backend
    # The decode's notification frees the prefill worker's blocks long before the hold timeout.
    served = await load_until(loads, p_inst.instance_id, lambda m: m.kv_held_blocks == 0, timeout=5)
    assert served.kv_transfers == 1 and served.kv_transfer_bytes == 5 * BLOCK_BYTES
    await sub.close()

    # The same prompt again: the decode worker now caches its four full blocks, reads only the
    # partial one, and the KV it holds still checks out against the prefill's checksum.
    _, again = await prefill(p_client, p_inst, "req-2", prompt)
    assert again.checksum == params.checksum and again.cached_tokens == 4 * BLOCK
    outs = await run_generate(d_client, d_inst, decode_request("req-2", prompt, msgspec.to_builtins(again)))
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert report["ok"] is True and report["local_hit_blocks"] == 4 and report["blocks"] == 1
    assert report["checksum"] == again.checksum
    assert p_daemon.alive() and d_daemon.alive()


async def test_prefill_killed_before_the_read_leaves_decode_to_prefill_locally(disagg) -> None:
    p_daemon, p_client, p_inst = await disagg.worker("prefill")
    d_daemon, d_client, d_inst = await disagg.worker("decode")
    prompt = list(range(500, 500 + 3 * BLOCK + 2))
    _, params = await prefill(p_client, p_inst, "req-k", prompt)
    p_daemon.kill()  # SIGKILL: no withdraw, the record lives until the lease runs out
    outs = await run_generate(d_client, d_inst, decode_request("req-k", prompt, msgspec.to_builtins(params), max_tokens=6))
    assert sum(len(o.token_ids) for o in outs) == 6 and outs[-1].finish_reason == "length"
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert report["ok"] is False and report["failure"] == "peer_lost" and report["reason"]
    assert outs[-1].usage.prompt_tokens == len(prompt)
    assert d_daemon.alive()
    assert "kv read failed, prefilling locally" in d_daemon.log()


async def test_hold_expires_when_no_decode_worker_reads(disagg) -> None:
    _, p_client, p_inst = await disagg.worker("prefill", "--kv-hold-timeout", "1")
    sub = await disagg.rt.namespace().component("prefill").subscribe("kv_metrics")
    loads = sub.__aiter__()
    await load_until(loads, p_inst.instance_id, lambda m: True)  # subscribed: later changes arrive
    _, params = await prefill(p_client, p_inst, "req-e", list(range(40)))
    assert len(params.block_ids) == 3
    await load_until(loads, p_inst.instance_id, lambda m: m.kv_held_blocks == 3)
    await load_until(loads, p_inst.instance_id, lambda m: m.kv_held_blocks == 0 and m.active_decode_blocks == 0, timeout=6)
    await sub.close()
