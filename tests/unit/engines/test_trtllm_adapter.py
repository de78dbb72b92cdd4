"""The TensorRT-LLM adapter's mapping logic on payloads in TensorRT-LLM's serialized formats
(tests/fixtures/recorded), and an end-to-end check that runs only where TensorRT-LLM imports (it
needs CUDA; never run here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynamod.daemon.engines.common.native_events import engine_hash_to_int
from dynamod.daemon.engines.trtllm.engine import TrtllmEngine, cached_tokens, llm_kwargs, sampling_params
from dynamod.daemon.engines.trtllm.kv_format import TrtllmEventMapper
from dynamod.daemon.models.local import load_model_dir, resolve_model
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import BlockRemoved, BlockStored, KvStored
from dynamod.shared.protocol.llm import PreprocessedRequest, SamplingOptions, StopConditions
from tests.unit.engines.recorded import load

REC = load("trtllm_kv_events.json")
B = REC["tokens_per_block"]


def test_events_map_with_dynamos_rules() -> None:
    mapper = TrtllmEventMapper(B)
    out = []
    for ev in REC["events"]:
        gap = mapper.gap_before(ev)
        out.append((gap, mapper.map(ev)))
    assert mapper.max_window == 4096  # learned from the leading "created" events
    gaps = [g for g, _ in out]
    assert gaps == [0, 0, 0, 0, 0, 0, 3]  # event ids 6..8 never arrived
    batches = [b for _, b in out if b is not None]
    stored = batches[0].events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2**63 + 5, 11]  # the partial third block is not indexed
    assert stored.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and stored.block_size == B
    # The sliding-window layer's store (window 128) and the "updated" event are dropped.
    removed = batches[1].events[0]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11]  # 12 was the partial block
    assert batches[2].events[0].parent_block_hash == 2**63 + 5
    assert len(batches) == 3


def test_mapped_events_feed_the_router_index() -> None:
    from dynamod.daemon.engines.common.native_kv import NativeKvEventQueue

    mapper, feed, index = TrtllmEventMapper(B), NativeKvEventQueue(0x77), KvIndexer()
    for ev in REC["events"][:4]:
        missing = mapper.gap_before(ev)
        if missing:
            feed.on_gap(0, missing)
        batch = mapper.map(ev)
        if batch is not None:
            feed.on_batch(0, batch)
    [ev] = [feed._queue.get_nowait() for _ in range(feed._queue.qsize())]  # noqa: SLF001
    assert isinstance(ev.event, KvStored)
    assert [b.tokens_hash for b in ev.event.blocks] == compute_block_hashes(list(range(1, 9)), B)
    assert ev.event.blocks[0].block_hash == engine_hash_to_int(2**63 + 5)
    index.apply_event(ev)
    assert index.find_matches(compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], B)).scores == {(0x77, 0): 2}


def test_llm_arguments(tmp_path) -> None:
    opts = llm_kwargs('{"tensor_parallel_size": 2, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}',
                      model_path="/m", context_length=2048)
    assert opts["model"] == "/m" and opts["tensor_parallel_size"] == 2 and opts["max_seq_len"] == 2048
    kv = opts["kv_cache_config"]
    assert kv == {"free_gpu_memory_fraction": 0.5, "enable_block_reuse": True, "event_buffer_max_size": 4096,
                  "tokens_per_block": 64}
    f = tmp_path / "opts.json"
    f.write_text('{"kv_cache_config": {"tokens_per_block": 32}}')
    assert llm_kwargs(f"@{f}", model_path="/m", context_length=None)["kv_cache_config"]["tokens_per_block"] == 32
    with pytest.raises(ConfigError):
        llm_kwargs("[1]", model_path="/m", context_length=None)
    with pytest.raises(ConfigError):
        llm_kwargs('{"model": "x"}', model_path="/m", context_length=None)


def test_sampling_usage_and_load() -> None:
    req = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2, 3],
                              sampling=SamplingOptions(temperature=0.2, logprobs=0),
                              stop=StopConditions(max_tokens=5, ignore_eos=True))
    assert sampling_params(req, context_length=100) == {"detokenize": False, "temperature": 0.2, "max_tokens": 5,
                                                        "ignore_eos": True, "logprobs": 1}
    assert cached_tokens(SimpleNamespace(cached_tokens=48, outputs=[]), B) == 48
    perf = SimpleNamespace(kv_cache_metrics=SimpleNamespace(num_reused_blocks=3))
    assert cached_tokens(SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=perf)]), B) == 3 * B
    engine = TrtllmEngine(llm_kwargs("", model_path="/m", context_length=None), resolve_model("tiny"), 0x9)
    engine._on_stats(REC["stats"])  # noqa: SLF001 - what the stats poller does
    engine._active["busy"] = object()  # noqa: SLF001
    [m] = engine.load_metrics()
    assert (m.total_blocks, m.active_decode_blocks, m.num_running, m.num_waiting) == (1024, 24, 2, 1)
    assert m.prefix_hit_rate == pytest.approx(0.75) and engine.info.runtime_config.total_kv_blocks == 1024


async def test_unsupported_controls_say_so() -> None:
    engine = TrtllmEngine(llm_kwargs("", model_path="/m", context_length=None), resolve_model("tiny"), 0x9)
    with pytest.raises(InvalidRequestError, match="no sleep mode"):
        await engine.sleep(1)
    with pytest.raises(InvalidRequestError, match="no way to drop"):
        await engine.clear_kv_blocks()


# -- end to end, only where TensorRT-LLM is installed (CUDA) -------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None, reason="TensorRT-LLM is not installed (it needs CUDA)")
async def test_real_trtllm_engine_end_to_end(tiny_model: Path) -> None:
    opts = llm_kwargs('{"kv_cache_config": {"free_gpu_memory_fraction": 0.2}}', model_path=str(tiny_model),
                      context_length=None)
    engine = TrtllmEngine(opts, load_model_dir(tiny_model), worker_id=0x71)
    await engine.start()
    try:
        prompt = list(range(100, 100 + 3 * B * 16 + 5))
        for rid in ("a", "b"):
            req = PreprocessedRequest(request_id=rid, model="m", token_ids=prompt,
                                      stop=StopConditions(max_tokens=4, ignore_eos=True))
            outs = [o async for o in engine.generate(req)]
            assert sum(len(o.token_ids) for o in outs) == 4 and outs[-1].finish_reason == "length"
        stored = []
        async for ev in engine.kv_events():
            stored.append(ev)
            if isinstance(ev.event, KvStored):
                break
        assert stored
    finally:
        await engine.stop()


def test_sampling_options_and_constraints_map_to_trtllm_names() -> None:
    from dynamod.shared.protocol.llm import GuidedDecoding, PreprocessedRequest, SamplingOptions

    def req(**kw: object) -> PreprocessedRequest:
        return PreprocessedRequest(request_id="r", model="m", token_ids=[1], sampling=SamplingOptions(**kw))

    sp = sampling_params(req(min_p=0.1, presence_penalty=0.5, repetition_penalty=1.2,
                             guided_decoding=GuidedDecoding(regex="a+")), context_length=100)
    assert (sp["min_p"], sp["presence_penalty"], sp["repetition_penalty"]) == (0.1, 0.5, 1.2)
    assert sp["guided_decoding"] == {"regex": "a+"}
    assert sampling_params(req(guided_decoding=GuidedDecoding(choice=["x", "y"])), context_length=9)[
        "guided_decoding"] == {"grammar": 'root ::= "x" | "y"'}
    for name, value in (("logit_bias", {1: 1.0}), ("allowed_token_ids", [1])):
        with pytest.raises(InvalidRequestError) as err:
            sampling_params(req(**{name: value}), context_length=9)
        assert err.value.param == name
