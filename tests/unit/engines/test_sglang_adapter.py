"""The SGLang adapter's mapping logic on SGLang-format payloads (tests/fixtures/recorded), and an
end-to-end check that runs only where SGLang imports (it needs CUDA; never run here)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from dynamod.daemon.engines.common.flags import flag_value
from dynamod.daemon.engines.common.kv_endpoints import SubscriberEndpoint
from dynamod.daemon.engines.common.kv_subscriber import NativeKvSubscriber
from dynamod.daemon.engines.common.native_events import engine_hash_to_int
from dynamod.daemon.engines.common.native_kv import NativeKvEventQueue
from dynamod.daemon.engines.sglang.engine import SglangEngine, sglang_argv
from dynamod.daemon.engines.sglang.kv_format import SglangFormatError, decode_sglang_batch
from dynamod.daemon.engines.sglang.outputs import SglangOutputTracker, sampling_params
from dynamod.daemon.models.local import load_model_dir
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvCleared, KvStored
from dynamod.shared.protocol.llm import PreprocessedRequest, SamplingOptions, StopConditions
from tests.unit.engines.recorded import frames, load

REC = load("sglang_kv_events.json")
LIVE = frames(REC)
REPLAY = frames(REC, "replay_from_seq_1")
PAGE = REC["page_size"]


def test_array_shaped_events_decode() -> None:
    first = decode_sglang_batch(LIVE[0][2])
    assert first.data_parallel_rank == 0
    [stored] = first.events
    assert isinstance(stored, BlockStored) and stored.block_size == PAGE and stored.block_hashes[0] == -7001
    kinds = [type(e) for m in LIVE for e in decode_sglang_batch(m[2]).events]
    assert kinds == [BlockStored, BlockStored, BlockRemoved, BlockStored, AllBlocksCleared]
    old = decode_sglang_batch(base64.b64decode(REC["pre_dp_rank_batch"]))  # releases without the rank
    assert old.data_parallel_rank is None and isinstance(old.events[0], BlockStored)
    with pytest.raises(SglangFormatError):
        decode_sglang_batch(b"\x93\x01\x02\x03")


def test_events_reach_the_router_index_with_router_hashes() -> None:
    feed, index = NativeKvEventQueue(0xA), KvIndexer()
    for m in LIVE[:2]:
        feed.on_batch(0, decode_sglang_batch(m[2]))
    events = []
    while not feed._queue.empty():  # noqa: SLF001
        events.append(feed._queue.get_nowait())
    for ev in events:
        index.apply_event(ev)
    first = events[0].event
    assert isinstance(first, KvStored)
    assert [b.tokens_hash for b in first.blocks] == compute_block_hashes(list(range(500, 548)), PAGE)
    assert first.blocks[0].block_hash == engine_hash_to_int(-7001)
    prompt = list(range(500, 548)) + list(range(900, 916))
    assert index.find_matches(compute_block_hashes(prompt, PAGE)).scores == {(0xA, 0): 4}


async def test_subscriber_replays_sglang_replay_frames(tmp_path) -> None:
    """SGLang's replay reply is [b"", seq, payload] (no topic); the subscriber takes both layouts."""
    assert REPLAY[0][0] == b"" and len(REPLAY[0]) == 3
    ctx = zmq.asyncio.Context()
    got: list[int] = []
    replay_address = f"ipc://{tmp_path}/replay.ipc"
    sub = NativeKvSubscriber([SubscriberEndpoint("tcp://127.0.0.1:*", bind=True)], decode=decode_sglang_batch,
                             on_batch=lambda r, b: got.append(len(b.events)), on_gap=lambda r, n: got.append(-n),
                             topic=REC["topic"], replay={0: replay_address}, ctx=ctx)
    sub.open()
    pub = ctx.socket(zmq.PUB)
    pub.connect(sub.bound[0])
    router = ctx.socket(zmq.ROUTER)
    router.bind(replay_address)

    async def serve() -> None:
        client, _, _start = await router.recv_multipart()
        for reply in REPLAY:
            await router.send_multipart([client, *reply])

    server = asyncio.create_task(serve())
    try:
        await asyncio.sleep(0.2)
        await pub.send_multipart(LIVE[0])
        await pub.send_multipart(LIVE[3])  # seq 1 and 2 come from the replay
        async with asyncio.timeout(5):
            while len(got) < 4:  # noqa: ASYNC110 - polls a condition with a deadline
                await asyncio.sleep(0.01)
        assert got == [1, 1, 2, 1] and sub.replayed == 2
    finally:
        server.cancel()
        pub.close(0)
        router.close(0)
        await sub.close()
        ctx.term()


def test_argv_and_sampling_mapping() -> None:
    argv = sglang_argv(["--tp-size", "2"], model_path="/m", kv_events_config={"publisher": "zmq"}, context_length=512)
    assert argv[:2] == ["--model-path", "/m"] and flag_value(argv, "--page-size") == "64"
    assert {"--skip-tokenizer-init", "--stream-output", "--enable-cache-report"} <= set(argv)
    assert flag_value(argv, "--context-length") == "512"
    with pytest.raises(ConfigError):
        sglang_argv(["--model-path", "x"], model_path="/m", kv_events_config={}, context_length=None)
    req = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2],
                              sampling=SamplingOptions(temperature=0.5, top_k=0, seed=3),
                              stop=StopConditions(max_tokens=4, stop_token_ids=[7], ignore_eos=True))
    sp = sampling_params(req, context_length=100)
    assert sp == {"temperature": 0.5, "top_k": -1, "sampling_seed": 3, "max_new_tokens": 4, "stop_token_ids": [7],
                  "ignore_eos": True}


def test_streamed_dicts_map_to_outputs() -> None:
    t = SglangOutputTracker(prompt_tokens=10)
    assert t.map({"output_ids": [5, 6], "meta_info": {"id": "x", "finish_reason": None, "prompt_tokens": 10}}).token_ids == [5, 6]
    assert t.map({"output_ids": [], "meta_info": {"finish_reason": None}}) is None
    last = t.map({"output_ids": [7], "meta_info": {"finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 10,
                                                   "completion_tokens": 3, "cached_tokens": 8}})
    assert last.finish_reason == "length" and t.rid == "x"
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (10, 8, 3)
    aborted = SglangOutputTracker(3).map({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}})
    assert aborted.finish_reason == "abort"


# -- end to end, only where SGLang is installed (CUDA) ------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed (it needs CUDA)")
async def test_real_sglang_engine_end_to_end(tiny_model: Path) -> None:
    engine = SglangEngine(["--mem-fraction-static", "0.3"], load_model_dir(tiny_model), worker_id=0x51)
    await engine.start()
    try:
        prompt = list(range(100, 100 + 3 * engine.info.kv_block_size + 5))
        for rid in ("a", "b"):
            req = PreprocessedRequest(request_id=rid, model="m", token_ids=prompt,
                                      stop=StopConditions(max_tokens=4, ignore_eos=True))
            outs = [o async for o in engine.generate(req)]
            assert sum(len(o.token_ids) for o in outs) == 4 and outs[-1].finish_reason == "length"
        assert outs[-1].usage.cached_tokens >= 3 * engine.info.kv_block_size
        assert await engine.clear_kv_blocks() >= 0
        events = []
        async with asyncio.timeout(10):
            async for ev in engine.kv_events():
                events.append(ev)
                if isinstance(ev.event, KvCleared):
                    break
        assert any(isinstance(e.event, KvStored) for e in events)
    finally:
        await engine.stop()


def test_sampling_options_and_constraints_map_to_sglang_names() -> None:
    from dynamod.shared.errors import InvalidRequestError
    from dynamod.shared.protocol.llm import GuidedDecoding

    req = PreprocessedRequest(request_id="r", model="m", token_ids=[1], sampling=SamplingOptions(
        min_p=0.1, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.2, logit_bias={7: -100.0},
        guided_decoding=GuidedDecoding(choice=['a "b"', "c"]),
    ))
    sp = sampling_params(req, context_length=100)
    assert (sp["min_p"], sp["presence_penalty"], sp["frequency_penalty"], sp["repetition_penalty"]) == (0.1, 0.5, 0.2, 1.2)
    assert sp["logit_bias"] == {"7": -100.0} and sp["ebnf"] == 'root ::= "a \\"b\\"" | "c"'
    schema = PreprocessedRequest(request_id="r", model="m", token_ids=[1],
                                 sampling=SamplingOptions(guided_decoding=GuidedDecoding(json={"type": "object"})))
    assert sampling_params(schema, context_length=100)["json_schema"] == '{"type": "object"}'
    refused = PreprocessedRequest(request_id="r", model="m", token_ids=[1], sampling=SamplingOptions(allowed_token_ids=[1]))
    with pytest.raises(InvalidRequestError) as err:
        sampling_params(refused, context_length=100)
    assert err.value.param == "allowed_token_ids"
    tracker = SglangOutputTracker(1)
    out = tracker.map({"output_ids": [5], "meta_info": {
        "output_token_logprobs": [(-0.4, 5, None)], "output_top_logprobs": [[(-1.0, 6, None), (-0.4, 5, None)]],
    }})
    assert out.log_probs == [-0.4] and out.top_logprobs == [[(5, -0.4), (6, -1.0)]]
