"""MockerEngine prefill and decode over real TCP transfer agents on loopback: holds, reads,
notifications, expiry and every fallback."""

from __future__ import annotations

import time

import msgspec
import pytest

from dynamod.daemon.engines.base import KvTransferEngine
from dynamod.daemon.engines.kv_transfer import KvTransferContext, KvTransferSettings
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.worker.kv_transfer import KvTransferStats
from dynamod.shared.errors import InvalidRequestError, NotFoundError
from dynamod.shared.kv.transfer.tcp import TcpKvAgent
from dynamod.shared.protocol.kv_transfer import KvLayout, KvTransferMetadata, KvTransferParams
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, StopConditions
from tests.unit.mocker.factories import make_config
from tests.unit.mocker.test_engine import until

BS = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4, block_size=BS)
PREFILL_ID, DECODE_ID = 0xA1, 0xD1


class Directory:
    """In-memory stand-in for KvTransferDirectory."""

    def __init__(self) -> None:
        self.records: dict[int, KvTransferMetadata] = {}

    async def lookup(self, worker_id: int, component: str = "prefill", *, timeout_s: float = 5.0) -> KvTransferMetadata:
        try:
            return self.records[worker_id]
        except KeyError:
            raise NotFoundError(f"no KV transfer agent for worker {worker_id:x}") from None


@pytest.fixture
async def pair():
    """A prefill and a decode engine, each with a TCP agent, sharing one directory."""
    directory = Directory()
    made: list[tuple[MockerEngine, TcpKvAgent]] = []

    async def make(worker_id: int, **settings) -> MockerEngine:
        engine = MockerEngine(make_config(num_gpu_blocks=64, speedup_ratio=1000.0), worker_id, kv_layout=LAYOUT)
        await engine.start()
        agent = TcpKvAgent(engine.kv_transfer_memory(), worker_id=worker_id, layout=LAYOUT)
        await agent.start()
        directory.records[worker_id] = agent.metadata()
        ctx = KvTransferContext(agent, directory, KvTransferStats(worker_id, agent.backend), KvTransferSettings(**settings))
        engine.attach_kv_transfer(ctx)
        made.append((engine, agent))
        return engine

    yield make, directory
    for engine, agent in made:
        await engine.stop()
        await agent.close()


def prefill_req(rid: str, tokens: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(request_id=rid, model="m", token_ids=tokens, prefill_only=True, stop=StopConditions(max_tokens=1))


def decode_req(rid: str, tokens: list[int], params: dict | None, max_tokens: int = 5) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=tokens, disaggregated_params=params,
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def run(engine: MockerEngine, request: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def held(engine: MockerEngine) -> int:
    return sum(m.kv_held_blocks for m in engine.load_metrics())


async def test_decode_reads_the_prefilled_blocks_and_notifies(pair) -> None:
    make, _ = pair
    prefill, decode = await make(PREFILL_ID), await make(DECODE_ID)
    assert isinstance(prefill, KvTransferEngine)
    prompt = list(range(1, 31))  # 7 full blocks + 2
    outs = await run(prefill, prefill_req("r", prompt))
    params = msgspec.convert(outs[-1].disaggregated_params, KvTransferParams)
    assert params.worker_id == PREFILL_ID and len(params.block_ids) == 8 and params.backend == "tcp"
    assert params.expires_at > time.time() + 50 and held(prefill) == 8

    outs = await run(decode, decode_req("r", prompt, msgspec.to_builtins(params)))
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert report["ok"] and report["checksum"] == params.checksum and report["blocks"] == 8
    assert sum(len(o.token_ids) for o in outs) == 5 and outs[0].token_ids[0] == params.first_token
    assert held(prefill) == 0  # the read carried the notification
    dm = decode.load_metrics()[0]
    assert dm.kv_transfers == 1 and dm.kv_transfer_bytes == 8 * LAYOUT.block_bytes and dm.kv_transfer_ms_p50 > 0
    pm = prefill.load_metrics()[0]
    assert pm.kv_transfers == 1 and pm.kv_transfer_failures == 0


async def test_hold_expires_without_a_reader(pair) -> None:
    make, _ = pair
    prefill = await make(PREFILL_ID, hold_timeout_s=0.05)
    await run(prefill, prefill_req("r", list(range(1, 10))))
    assert held(prefill) == 3
    await until(lambda: held(prefill) == 0)
    assert prefill._kv.ctx.stats.holds_expired == 1
    assert prefill.load_metrics()[0].active_decode_blocks == 0


async def test_missing_agent_record_falls_back_to_local_prefill(pair) -> None:
    make, directory = pair
    prefill, decode = await make(PREFILL_ID), await make(DECODE_ID)
    prompt = list(range(1, 20))
    outs = await run(prefill, prefill_req("r", prompt))
    del directory.records[PREFILL_ID]
    outs = await run(decode, decode_req("r", prompt, outs[-1].disaggregated_params))
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert not report["ok"] and report["failure"] == "peer_lost" and "no KV transfer agent" in report["reason"]
    assert sum(len(o.token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
    assert decode.load_metrics()[0].kv_transfer_failures == 1
    assert held(prefill) == 5  # nobody could tell it: the hold expires on its own


async def test_corrupted_blocks_fail_the_checksum_and_prefill_locally(pair) -> None:
    make, _ = pair
    prefill, decode = await make(PREFILL_ID), await make(DECODE_ID)
    prompt = list(range(1, 20))
    outs = await run(prefill, prefill_req("r", prompt))
    params = outs[-1].disaggregated_params
    prefill.kv_transfer_memory().array[params["block_ids"][1], :8] ^= 0xFF  # bytes change after the checksum
    outs = await run(decode, decode_req("r", prompt, params))
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert not report["ok"] and report["failure"] == "checksum" and report["checksum"] != report["expected"]
    assert outs[-1].finish_reason == "length"
    assert held(prefill) == 0 and decode._kv.ctx.stats.failures_by_reason == {"checksum": 1}


async def test_unreachable_peer_is_reported_and_the_stream_completes(pair) -> None:
    make, _ = pair
    prefill, decode = await make(PREFILL_ID), await make(DECODE_ID, transfer_timeout_s=2.0)
    prompt = list(range(1, 20))
    outs = await run(prefill, prefill_req("r", prompt))
    await prefill._kv.ctx.agent.close()  # the block server is gone, its record is still there
    outs = await run(decode, decode_req("r", prompt, outs[-1].disaggregated_params))
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert not report["ok"] and report["failure"] == "peer_lost"
    assert sum(len(o.token_ids) for o in outs) == 5


async def test_bad_params_name_the_field(pair) -> None:
    make, _ = pair
    decode = await make(DECODE_ID)
    for bad in ({"bootstrap_room": 7}, {"transfer_id": "t", "worker_id": "x", "block_ids": [], "num_tokens": 1}):
        with pytest.raises(InvalidRequestError) as info:
            await run(decode, decode_req("r", [1, 2, 3], bad))
        assert info.value.param == "disaggregated_params"


async def test_engine_without_agent_prefills_locally_and_holds_nothing() -> None:
    engine = MockerEngine(make_config(num_gpu_blocks=64, speedup_ratio=1000.0), 0xA6)
    await engine.start()
    try:
        assert engine.kv_transfer_memory() is None
        outs = await run(engine, prefill_req("p", [1, 2, 3, 4, 5]))
        assert outs[-1].disaggregated_params is None and held(engine) == 0
        params = {"transfer_id": "t", "worker_id": 1, "block_ids": [0, 1], "num_tokens": 5}
        outs = await run(engine, decode_req("d", [1, 2, 3, 4, 5], params))
        assert sum(len(o.token_ids) for o in outs) == 5
        assert outs[-1].disaggregated_params["kv_transfer"]["ok"] is False
    finally:
        await engine.stop()


async def test_stop_releases_holds_and_ends_reads(pair) -> None:
    make, _ = pair
    prefill = await make(PREFILL_ID)
    await run(prefill, prefill_req("r", list(range(1, 10))))
    assert held(prefill) == 3
    await prefill.stop()
    assert prefill._kv.ctx.stats.held_blocks == 0 and prefill.cores[0].holds == {}


async def test_sleep_and_clear_release_holds(pair) -> None:
    make, _ = pair
    prefill = await make(PREFILL_ID)
    await run(prefill, prefill_req("a", list(range(1, 10))))
    await prefill.clear_kv_blocks()
    assert held(prefill) == 0 and prefill._kv.ctx.stats.held_blocks == 0 and prefill._kv._expiry == {}
    await run(prefill, prefill_req("b", list(range(1, 10))))
    await prefill.sleep(1)
    assert held(prefill) == 0 and prefill.load_metrics()[0].active_decode_blocks == 0


async def test_data_parallel_ranks_hold_and_read_distinct_rows(pair) -> None:
    make, directory = pair
    prefill = MockerEngine(make_config(num_gpu_blocks=32, speedup_ratio=1000.0, data_parallel_size=2), 0xA2, kv_layout=LAYOUT)
    await prefill.start()
    agent = TcpKvAgent(prefill.kv_transfer_memory(), worker_id=0xA2, layout=LAYOUT)
    await agent.start()
    directory.records[0xA2] = agent.metadata()
    prefill.attach_kv_transfer(KvTransferContext(agent, directory, KvTransferStats(0xA2, "tcp"), KvTransferSettings()))
    decode = await make(DECODE_ID)
    try:
        assert prefill.kv_transfer_memory().num_blocks == 64
        prompt = list(range(1, 12))
        request = prefill_req("r", prompt)
        request.dp_rank = 1
        params = (await run(prefill, request))[-1].disaggregated_params
        assert params["dp_rank"] == 1 and min(params["block_ids"]) >= 32  # rank 1: rows 32..63
        outs = await run(decode, decode_req("r", prompt, params))
        assert outs[-1].disaggregated_params["kv_transfer"]["ok"]
        assert held(prefill) == 0
    finally:
        await prefill.stop()
        await agent.close()
