"""MockerEngine: the async Engine Protocol around mocker cores (streams, aborts, events, control).

stop() keeping its caller's cancellation is a repair found in review: that test fails without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from dynamod.daemon.engines.base import Engine
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.engines.mocker.sampling import TokenSampler
from dynamod.shared.errors import ContextLengthError, InvalidRequestError, NotFoundError, UnavailableError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvCleared, KvStored, RouterEvent
from dynamod.shared.protocol.llm import (
    FINISH_ERROR,
    EngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from tests.fixtures.cancellation import close_check
from tests.fixtures.started import started_by
from tests.unit.mocker.factories import make_config

WORKER_ID = 0xABC


def request(rid: str, tokens: list[int], max_tokens: int, **kwargs) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="mock", token_ids=tokens, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True), **kwargs
    )


async def collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [out async for out in stream]


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.002)


def drain_events(engine: MockerEngine) -> list[RouterEvent]:
    out = []
    while not engine._events.empty():
        event = engine._events.get_nowait()
        if event is not None:
            out.append(event)
    return out


def _engine(**overrides: Any) -> MockerEngine:
    """A small, fast mocker engine (not started); ``overrides`` replace its config's knobs."""
    return MockerEngine(make_config(**{"num_gpu_blocks": 64, "speedup_ratio": 1000.0, **overrides}), worker_id=WORKER_ID)


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[MockerEngine]]]:
    async with started_by(_engine, MockerEngine.start, MockerEngine.stop) as make:
        yield make


async def test_implements_the_engine_protocol(make_engine):
    engine = await make_engine()
    assert isinstance(engine, Engine)
    assert engine.info.kv_block_size == 4 and engine.info.runtime_config.total_kv_blocks == 64
    assert engine.info.context_length == 256


async def test_generate_streams_every_token_then_usage(make_engine):
    engine = await make_engine()
    outs = await collect(engine.generate(request("r", list(range(1, 11)), 20)))
    assert sum(len(o.token_ids) for o in outs) == 20
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason == "length"
    assert outs[-1].usage.completion_tokens == 20 and outs[-1].usage.prompt_tokens == 10
    assert engine.num_active_requests == 0

    again = await collect(engine.generate(request("r2", list(range(1, 11)), 2)))
    assert again[-1].usage.cached_tokens == 8


async def test_steps_are_paced_by_the_timing_model_and_speedup(make_engine):
    engine = await make_engine(speedup_ratio=10.0)
    start = time.monotonic()
    await collect(engine.generate(request("r", list(range(1, 11)), 20)))
    elapsed = time.monotonic() - start
    simulated_s = engine.loop_stats()[0].simulated_ms / 1000.0
    assert simulated_s > 0.1  # one prefill (~16.7 ms) and 19 decode steps (>= 5.74 ms each)
    # Steps due within the timer resolution (1 ms) may be delivered that much early, never more.
    assert elapsed >= simulated_s / 10.0 - 0.0011


async def test_closing_the_stream_aborts_the_request(make_engine):
    engine = await make_engine(speedup_ratio=1.0)
    stream = engine.generate(request("r", list(range(1, 11)), 200))
    first = await stream.__anext__()
    assert first.token_ids and first.finish_reason is None
    (metrics,) = engine.load_metrics()
    assert metrics.num_running == 1 and metrics.active_decode_blocks >= 3
    await stream.aclose()
    assert engine.num_active_requests == 0
    assert not engine.cores[0].has_unfinished_requests()
    (metrics,) = engine.load_metrics()
    assert metrics.num_running == 0 and metrics.kv_usage == 0.0


async def test_load_metrics_describe_each_rank(make_engine):
    engine = await make_engine(speedup_ratio=1.0, max_num_seqs=1)
    first = engine.generate(request("a", list(range(1, 11)), 200))
    await first.__anext__()
    waiting = engine.generate(request("b", list(range(1, 31)), 5))
    pending = asyncio.ensure_future(waiting.__anext__())
    await until(lambda: engine.load_metrics()[0].num_waiting == 1)
    (metrics,) = engine.load_metrics()
    assert metrics.worker_id == WORKER_ID and metrics.dp_rank == 0 and metrics.status == "ready"
    assert metrics.num_running == 1 and metrics.total_blocks == 64
    assert metrics.active_prefill_tokens == 30
    assert metrics.kv_usage == pytest.approx(metrics.active_decode_blocks / 64)
    await engine.abort("a")
    final = await first.__anext__()
    assert final.finish_reason == "abort"
    assert (await pending).token_ids
    await waiting.aclose()


async def test_kv_events_carry_ids_worker_and_router_hashes(make_engine):
    engine = await make_engine()
    prompt = list(range(1, 18))
    outs = await collect(engine.generate(request("r", prompt, 8)))
    produced = [t for o in outs for t in o.token_ids]
    events = []
    iterator = engine.kv_events()
    while len(events) < 1 or engine.last_event_id > events[-1].event_id:
        events.append(await asyncio.wait_for(iterator.__anext__(), 5))
    assert [e.event_id for e in events] == list(range(len(events)))
    assert {(e.worker_id, e.dp_rank) for e in events} == {(WORKER_ID, 0)}
    stored = [b for e in events if isinstance(e.event, KvStored) for b in e.event.blocks]
    local, seq = hash_tokens((prompt + produced)[:24], 4)
    assert [(b.block_hash, b.tokens_hash) for b in stored] == list(zip(seq, local, strict=True))

    dump = await engine.kv_dump()
    assert {e.event_id for e in dump} == {engine.last_event_id}
    assert [b.block_hash for e in dump for b in e.event.blocks] == seq


async def test_clear_kv_blocks_emits_cleared_and_frees(make_engine):
    engine = await make_engine()
    await collect(engine.generate(request("r", list(range(1, 18)), 2)))
    drain_events(engine)
    assert await engine.clear_kv_blocks() == 4
    (event,) = drain_events(engine)
    assert isinstance(event.event, KvCleared)
    assert await engine.kv_dump() == []
    outs = await collect(engine.generate(request("r2", list(range(1, 18)), 2)))
    assert outs[-1].usage.cached_tokens == 0


async def test_sleep_aborts_refuses_and_wake_up_restores(make_engine):
    engine = await make_engine(speedup_ratio=1.0)
    stream = engine.generate(request("r", list(range(1, 11)), 200))
    await stream.__anext__()
    await engine.sleep(1)
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    assert engine.load_metrics()[0].status == "sleeping"
    assert any(isinstance(e.event, KvCleared) for e in drain_events(engine))
    assert engine.load_metrics()[0].kv_usage == 0.0
    with pytest.raises(UnavailableError, match="asleep"):
        await collect(engine.generate(request("x", [1, 2], 2)))
    with pytest.raises(InvalidRequestError):
        await engine.sleep(3)
    await engine.sleep(2)
    assert engine.sleep_level == 2

    await engine.wake_up()
    assert engine.sleep_level == 0 and engine.load_metrics()[0].status == "ready"
    outs = await collect(engine.generate(request("y", [1, 2], 3)))
    assert outs[-1].finish_reason == "length"


async def test_lora_adapters_must_be_loaded_and_hash_in_their_own_space(make_engine):
    engine = await make_engine()
    prompt = list(range(1, 10))
    with pytest.raises(InvalidRequestError, match="not loaded"):
        await collect(engine.generate(request("r", prompt, 2, lora_name="sql")))
    info = await engine.load_lora("sql", "/adapters/sql")
    assert info.lora_id == 1 and [i.name for i in engine.list_loras()] == ["sql"]
    assert await engine.load_lora("sql", "/adapters/sql") == info
    with pytest.raises(InvalidRequestError, match="already loaded"):
        await engine.load_lora("sql", "/elsewhere")

    await collect(engine.generate(request("base", prompt, 1)))
    outs = await collect(engine.generate(request("lora", prompt, 1, lora_name="sql")))
    assert outs[-1].usage.cached_tokens == 0  # the base model's blocks are not shared
    stored = [e.event for e in drain_events(engine) if isinstance(e.event, KvStored)]
    assert [s.lora_name for s in stored] == [None, "sql"]
    assert [b.block_hash for b in stored[1].blocks] == hash_tokens(prompt, 4, "sql")[1]

    await engine.unload_lora("sql")
    assert engine.list_loras() == []
    with pytest.raises(NotFoundError):
        await engine.unload_lora("sql")


async def test_data_parallel_ranks(make_engine):
    engine = await make_engine(speedup_ratio=1.0, data_parallel_size=2)
    pinned = engine.generate(request("a", list(range(1, 11)), 200, dp_rank=1))
    await pinned.__anext__()
    assert [m.num_running for m in engine.load_metrics()] == [0, 1]
    balanced = engine.generate(request("b", list(range(1, 11)), 200))
    await balanced.__anext__()
    assert [m.num_running for m in engine.load_metrics()] == [1, 1]
    with pytest.raises(InvalidRequestError, match="dp_rank 2 out of range"):
        await collect(engine.generate(request("c", [1], 1, dp_rank=2)))
    assert {e.dp_rank for e in drain_events(engine)} == {0, 1}
    await pinned.aclose()
    await balanced.aclose()


async def test_invalid_requests_raise_when_iteration_starts(make_engine):
    engine = await make_engine(context_length=32, speedup_ratio=1.0)
    with pytest.raises(ContextLengthError, match="maximum context length is 32"):
        await collect(engine.generate(request("r", [1] * 30, 10)))
    stream = engine.generate(request("dup", [1, 2], 25))
    await stream.__anext__()
    with pytest.raises(InvalidRequestError, match="already in flight"):
        await collect(engine.generate(request("dup", [1, 2], 1)))
    await stream.aclose()


async def test_stop_fails_in_flight_requests_and_ends_kv_events():
    engine = MockerEngine(make_config(num_gpu_blocks=64, speedup_ratio=1.0), worker_id=1)
    with pytest.raises(UnavailableError, match="not started"):
        await collect(engine.generate(request("early", [1], 1)))
    await engine.start()
    stream = engine.generate(request("r", list(range(1, 11)), 200))
    await stream.__anext__()
    events = engine.kv_events()
    await engine.stop()
    with pytest.raises(UnavailableError, match="stopped"):
        await stream.__anext__()
    remaining = [e async for e in events]
    assert all(isinstance(e, RouterEvent) for e in remaining)
    with pytest.raises(UnavailableError):
        await collect(engine.generate(request("late", [1], 1)))


@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 5e-324},  # found by schemathesis: 1/r overflows float32, inf - inf = NaN
        {"repetition_penalty": 100.0, "temperature": 2.0},
        {"temperature": 1e-300, "repetition_penalty": 1e-300},  # below vLLM's epsilon: greedy
        {"presence_penalty": 2.0, "frequency_penalty": -2.0, "logit_bias": {1: 100.0, 2: -100.0}},
    ],
)
async def test_extreme_but_valid_sampling_parameters_generate(make_engine, options):
    engine = await make_engine()
    prompt = [1, 2, 3, 1, 2, 3, 4, 5]
    outs = await collect(engine.generate(request("x", prompt, 12, sampling=SamplingOptions(**options))))
    assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 12


async def test_a_request_whose_sampling_fails_fails_alone(make_engine, monkeypatch):
    """One request's sampler raising (a bug, a parameter no check foresaw) fails that request with
    an error; the other requests in the same batch finish as if nothing happened."""
    engine = await make_engine(speedup_ratio=100.0)
    real = TokenSampler.sample

    def sample(self, req):  # noqa: ANN001, ANN202
        if req.request_id == "bad" and req.num_output_tokens == 3:
            raise FloatingPointError("probabilities are not finite")
        return real(self, req)

    monkeypatch.setattr(TokenSampler, "sample", sample)
    opts = SamplingOptions(temperature=0.7, presence_penalty=0.5)  # a penalty: the sampler runs
    good = asyncio.ensure_future(collect(engine.generate(request("good", list(range(1, 9)), 30, sampling=opts))))
    bad = await collect(engine.generate(request("bad", list(range(11, 19)), 30, sampling=opts)))
    assert bad[-1].finish_reason == FINISH_ERROR and sum(len(o.token_ids) for o in bad) == 3
    outs = await good
    assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 30
    await until(lambda: engine.num_active_requests == 0)


async def test_mocker_engine_stop_keeps_the_callers_cancellation() -> None:
    for expect_cancel in (True, False):
        engine = MockerEngine(make_config(), worker_id=1)
        await engine.start()

        def install(task: asyncio.Task[None], engine: MockerEngine = engine) -> None:
            engine._tasks.append(task)

        await close_check(expect_cancel)(install, engine.stop)
        # The cleanup ran either way: kv_events() ends.
        assert engine._events.get_nowait() is None
