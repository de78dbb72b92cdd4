"""The mocker's KV transfer overlapped with its prefill (``--kv-transfer-overlap chunk``), engine to
engine over real TCP agents: the prefill sends streaming parameters when the prompt is admitted,
the decode reads each chunk's blocks as they are computed and gets the checksum with the last one;
an aborted prefill fails the read and the decode prefills locally."""

from __future__ import annotations

import asyncio

import pytest

from dynamod.daemon.engines.kv_transfer import KvTransferContext, KvTransferSettings
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.worker.kv_transfer import KvTransferStats
from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.kv.transfer.factory import create_agent
from dynamod.shared.protocol.kv_transfer import KvLayout
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, StopConditions
from tests.unit.kv_transfer.support import BACKENDS, eventually
from tests.unit.mocker.factories import make_config
from tests.unit.mocker.test_disagg_engine import Directory

BS = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4, block_size=BS)
PREFILL_ID, DECODE_ID = 0xA1, 0xD1
PROMPT = list(range(1, 62))  # 16 blocks (the last partial), 4 chunks of 16 tokens


@pytest.fixture(params=BACKENDS)
async def pair(request):
    """A prefill engine that streams its holds (one 16-token chunk per ~17 ms step) and a decode
    engine, over each backend (NIXL: readiness long-polled, bytes over NIXL READs)."""
    directory = Directory()
    made: list[tuple[MockerEngine, KvTransferAgent]] = []

    async def make(worker_id: int, speedup: float, overlap: str) -> MockerEngine:
        config = make_config(num_gpu_blocks=64, max_num_batched_tokens=16, speedup_ratio=speedup)
        engine = MockerEngine(config, worker_id, kv_layout=LAYOUT)
        await engine.start()
        agent = create_agent(engine.kv_transfer_memory(), worker_id=worker_id, backend=request.param, layout=LAYOUT)
        await agent.start()
        directory.records[worker_id] = agent.metadata()
        stats = KvTransferStats(worker_id, agent.backend)
        engine.attach_kv_transfer(KvTransferContext(agent, directory, stats, KvTransferSettings(overlap=overlap)))
        made.append((engine, agent))
        return engine

    prefill, decode = await make(PREFILL_ID, 1.0, "chunk"), await make(DECODE_ID, 1000.0, "none")
    yield prefill, decode
    for engine, agent in made:
        await engine.stop()
        await agent.close()


def prefill_req() -> PreprocessedRequest:
    return PreprocessedRequest(request_id="r", model="m", token_ids=PROMPT, prefill_only=True, stop=StopConditions(max_tokens=1))


def decode_req(params: dict) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=PROMPT, disaggregated_params=params,
        stop=StopConditions(max_tokens=5, ignore_eos=True),
    )


async def collect(engine: MockerEngine, request: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def held(engine: MockerEngine) -> int:
    return sum(m.kv_held_blocks for m in engine.load_metrics())


async def test_decode_reads_the_blocks_while_the_prefill_computes_them(pair) -> None:
    prefill, decode = pair
    stream = prefill.generate(prefill_req())
    early = await anext(stream)
    params = early.disaggregated_params
    assert early.token_ids == [] and early.finish_reason is None
    assert params["streaming"] is True and "checksum" not in params and len(params["block_ids"]) == 16
    reading = asyncio.create_task(collect(decode, decode_req(params)))
    # The read starts before the prefill's last chunk: bytes land while it computes.
    await eventually(lambda: decode.cores[0].scheduler.waiting_for_remote, what="the decode waiting for its KV")
    rest = [out async for out in stream]
    final = rest[-1].disaggregated_params
    assert rest[-1].finish_reason is not None and final["transfer_id"] == params["transfer_id"]
    outs = await asyncio.wait_for(reading, 10)
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert report["ok"] and report["streamed"] and report["blocks"] == 16
    assert report["checksum"] == report["expected"] == final["checksum"]  # the checksum came with the last block
    assert 0 <= report["exposed_ms"] < report["ms"]  # most of the read overlapped the prefill
    assert sum(len(o.token_ids) for o in outs) == 5 and outs[0].token_ids[0] == final["first_token"]
    assert outs[0].disaggregated_params["kv_transfer"] == report  # also with the first token (route-explain)
    await eventually(lambda: held(prefill) == 0, what="the hold released by the read's notification")
    assert len(prefill.kv_transfer_memory().readiness) == 0
    assert decode._kv.ctx.stats.exposed_percentiles_ms()[0] == pytest.approx(report["exposed_ms"], abs=1e-3)


async def test_an_aborted_prefill_fails_the_read_and_the_decode_prefills_locally(pair) -> None:
    prefill, decode = pair
    stream = prefill.generate(prefill_req())
    params = (await anext(stream)).disaggregated_params
    reading = asyncio.create_task(collect(decode, decode_req(params)))
    await eventually(lambda: decode.cores[0].scheduler.waiting_for_remote, what="the decode waiting for its KV")
    await stream.aclose()  # the frontend went away: the prefill is aborted mid-prompt
    outs = await asyncio.wait_for(reading, 10)
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert not report["ok"] and report["streamed"] and "aborted" in report["reason"]
    assert sum(len(o.token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
    assert held(prefill) == 0 and len(prefill.kv_transfer_memory().readiness) == 0
    assert decode._kv.ctx.stats.failures == 1


async def test_a_reader_that_gives_up_frees_the_hold_when_the_prefill_ends(pair) -> None:
    prefill, decode = pair
    stream = prefill.generate(prefill_req())
    params = (await anext(stream)).disaggregated_params
    # The decode worker lets go before the prefill ends (its read failed; it prefills locally).
    await decode._kv.ctx.agent.notify(prefill._kv.ctx.agent.metadata(), f"{params['transfer_id']}|0", timeout_s=2)
    rest = [out async for out in stream]
    assert rest[-1].finish_reason is not None
    await eventually(lambda: held(prefill) == 0, what="the hold freed as it was made")
    assert len(prefill.kv_transfer_memory().readiness) == 0
