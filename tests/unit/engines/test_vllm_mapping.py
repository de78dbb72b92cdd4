"""The vLLM adapter's pure mapping logic: flags passed through, who binds the KV event sockets,
sampling and output mapping, load from scheduler stats, the block table behind ``kv_dump``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dynamod.daemon.engines.common.flags import engine_tokens, flag_value, user_kv_events_config
from dynamod.daemon.engines.common.kv_endpoints import offset_endpoint, plan_kv_events, publisher_binds
from dynamod.daemon.engines.common.kv_table import KvBlockTable
from dynamod.daemon.engines.vllm import flags
from dynamod.daemon.engines.vllm.outputs import OutputTracker, sampling_kwargs
from dynamod.daemon.engines.vllm.stats import LoadTracker
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.llm import PreprocessedRequest, SamplingOptions, StopConditions

# -- flags ----------------------------------------------------------------------------------------


def test_engine_argv_sets_model_kv_events_and_defaults() -> None:
    tokens = engine_tokens("--enforce-eager --max-num-seqs 8")
    argv = flags.engine_argv(tokens, model_path="/m", kv_events_config={"endpoint": "tcp://127.0.0.1:5"})
    assert argv[:2] == ["--model", "/m"]
    assert flag_value(argv, "--block-size") == "64"
    assert "--enable-prefix-caching" in argv and "--disable-log-stats" in argv
    assert json.loads(flag_value(argv, "--kv-events-config")) == {"endpoint": "tcp://127.0.0.1:5"}
    assert flag_value(argv, "--max-num-seqs") == "8"


def test_operator_choices_win() -> None:
    tokens = engine_tokens(
        "--block-size=128 --no-enable-prefix-caching --no-disable-log-stats --max-model-len 512 "
        "--kv-events-config '{\"endpoint\": \"tcp://*:7000\"}'"
    )
    argv = flags.engine_argv(tokens, model_path="/m", kv_events_config={"x": 1}, max_model_len=999)
    assert flag_value(argv, "--block-size") == "128" and "--block-size" not in argv
    assert "--enable-prefix-caching" not in argv and "--disable-log-stats" not in argv
    assert flag_value(argv, "--max-model-len") == "512"
    assert argv.count("--kv-events-config") == 1  # ours replaces theirs (it was built on theirs)
    assert flags.prefix_caching_disabled(tokens)
    assert user_kv_events_config(tokens) == {"endpoint": "tcp://*:7000"}
    est = flags.estimates(tokens)
    assert (est.block_size, est.max_model_len, est.data_parallel_size) == (128, 512, 1)


def test_model_inside_engine_args_is_refused() -> None:
    with pytest.raises(ConfigError, match="--model"):
        flags.engine_argv(["--model", "x"], model_path="/m", kv_events_config={})
    with pytest.raises(ConfigError):
        engine_tokens('--unbalanced "quote')


def test_passthrough_tokens_are_appended() -> None:
    assert engine_tokens("--a 1", ["--b", "2"]) == ["--a", "1", "--b", "2"]


# -- KV event endpoints ---------------------------------------------------------------------------


def test_default_plan_binds_loopback_and_replays_over_ipc(tmp_path) -> None:
    plan = plan_kv_events(None, data_parallel_size=1, private_dir=str(tmp_path))
    assert [(e.address, e.bind) for e in plan.subscribe] == [("tcp://127.0.0.1:*", True)]
    plan.resolve(["tcp://127.0.0.1:6000"])  # the port the subscriber's bind got
    assert plan.config["endpoint"] == "tcp://127.0.0.1:6000"
    assert not publisher_binds(plan.config["endpoint"])  # so vLLM connects to our bound SUB
    assert plan.replay == {0: f"ipc://{tmp_path}/kv-replay.ipc"}
    assert plan.config["enable_kv_cache_events"] is True and plan.config["publisher"] == "zmq"


def test_data_parallel_ranks_get_consecutive_ports(tmp_path) -> None:
    plan = plan_kv_events(None, data_parallel_size=3, private_dir=str(tmp_path), sub_base_port=6000,
                          replay_base_port=7000)
    assert [e.address for e in plan.subscribe] == [f"tcp://127.0.0.1:{6000 + r}" for r in range(3)]
    assert plan.replay == {r: f"tcp://127.0.0.1:{7000 + r}" for r in range(3)}


def test_operator_endpoint_the_engine_binds_is_connected_to(tmp_path) -> None:
    plan = plan_kv_events({"endpoint": "tcp://*:5557", "topic": "t"}, data_parallel_size=2, private_dir=str(tmp_path),
                          replay_base_port=7000)
    assert [(e.address, e.bind) for e in plan.subscribe] == [("tcp://127.0.0.1:5557", False), ("tcp://127.0.0.1:5558", False)]
    assert plan.topic == "t"
    ipc = plan_kv_events({"endpoint": "ipc:///run/kv.ipc"}, data_parallel_size=1, private_dir=str(tmp_path))
    assert [(e.address, e.bind) for e in ipc.subscribe] == [("ipc:///run/kv.ipc", False)]
    other = plan_kv_events({"endpoint": "tcp://127.0.0.1:9000"}, data_parallel_size=1, private_dir=str(tmp_path))
    assert [(e.address, e.bind) for e in other.subscribe] == [("tcp://127.0.0.1:9000", True)]


def test_bad_operator_configs(tmp_path) -> None:
    with pytest.raises(ValueError, match="disabled"):
        plan_kv_events({"enable_kv_cache_events": False}, data_parallel_size=1, private_dir=str(tmp_path))
    with pytest.raises(ValueError):
        offset_endpoint("ipc:///x", 1)


# -- sampling and outputs -------------------------------------------------------------------------


def req(**kw) -> PreprocessedRequest:
    return PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2, 3], **kw)


def test_sampling_from_request_and_model_defaults() -> None:
    r = req(sampling=SamplingOptions(temperature=0.0, seed=7, logprobs=0),
            stop=StopConditions(max_tokens=5, min_tokens=2, stop_token_ids=[9], ignore_eos=True))
    kw = sampling_kwargs(r, context_length=100, model_defaults={"temperature": 0.6, "top_p": 0.9, "top_k": -1,
                                                                  "repetition_penalty": 1.1})
    assert kw["temperature"] == 0.0 and kw["top_p"] == 0.9 and kw["top_k"] == 0 and kw["seed"] == 7
    assert kw["repetition_penalty"] == 1.1
    assert (kw["max_tokens"], kw["min_tokens"], kw["stop_token_ids"], kw["ignore_eos"]) == (5, 2, [9], True)
    assert kw["logprobs"] == 0 and kw["detokenize"] is False and kw["n"] == 1
    unbounded = sampling_kwargs(req(), context_length=100)
    assert unbounded["max_tokens"] == 97 and "temperature" not in unbounded


def ro(tokens, finish=None, cached=None, finished=False, logprobs=None):
    comp = SimpleNamespace(token_ids=tokens, finish_reason=finish, logprobs=logprobs)
    return SimpleNamespace(outputs=[comp], finished=finished or finish is not None, num_cached_tokens=cached)


def test_delta_outputs_and_final_usage() -> None:
    t = OutputTracker(prompt_tokens=100)
    assert t.map(ro([5], cached=64)).token_ids == [5]
    assert t.map(ro([])) is None
    last = t.map(ro([6, 7], finish="length", cached=64))
    assert last.finish_reason == "length" and last.token_ids == [6, 7]
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (100, 64, 3)


def test_abort_and_logprobs() -> None:
    t = OutputTracker(prompt_tokens=3)
    out = t.map(ro([5], logprobs=[{5: SimpleNamespace(logprob=-0.5), 6: SimpleNamespace(logprob=-2.0)}]))
    assert out.log_probs == [-0.5]
    final = t.map(ro([], finish="abort"))
    assert final.finish_reason == "abort" and final.usage.completion_tokens == 1
    assert t.aborted().finish_reason == "abort"


def test_every_sampling_option_and_constraint_maps_to_vllm_names() -> None:
    from dynamod.shared.protocol.llm import GuidedDecoding

    r = req(sampling=SamplingOptions(
        min_p=0.1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3, logit_bias={4: -100.0},
        allowed_token_ids=[4, 5], guided_decoding=GuidedDecoding(json={"type": "object"}, whitespace_pattern=" ?"),
    ))
    kw = sampling_kwargs(r, context_length=100, model_defaults={"repetition_penalty": 1.1, "min_p": 0.0})
    assert (kw["min_p"], kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"]) == (0.1, 0.5, 0.25, 1.3)
    assert kw["logit_bias"] == {4: -100.0} and kw["allowed_token_ids"] == [4, 5]
    assert kw["structured_outputs"] == {"json": {"type": "object"}, "whitespace_pattern": " ?"}
    for guided, expected in (
        (GuidedDecoding(regex="a+"), {"regex": "a+"}),
        (GuidedDecoding(choice=["x"]), {"choice": ["x"]}),
        (GuidedDecoding(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ):
        assert sampling_kwargs(req(sampling=SamplingOptions(guided_decoding=guided)), context_length=9)[
            "structured_outputs"] == expected


def test_top_logprobs_by_rank() -> None:
    t = OutputTracker(prompt_tokens=3, num_top=2)
    position = {
        9: SimpleNamespace(logprob=-3.0, rank=5),  # the sampled token, outside the top two
        5: SimpleNamespace(logprob=-0.5, rank=1),
        6: SimpleNamespace(logprob=-1.0, rank=2),
    }
    out = t.map(ro([9], logprobs=[position]))
    assert out.log_probs == [-3.0] and out.top_logprobs == [[(5, -0.5), (6, -1.0)]]
    assert OutputTracker(prompt_tokens=3).map(ro([9], logprobs=[position])).top_logprobs is None


# -- load -----------------------------------------------------------------------------------------


def stats(running, waiting, usage, queries=0, hits=0, reset=False):
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                           prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits, reset=reset))


def test_load_from_scheduler_stats() -> None:
    tracker = LoadTracker(data_parallel_size=2)
    tracker.total_blocks_per_rank = 1000
    tracker.record(0, stats(3, 1, 0.25, queries=200, hits=50))
    tracker.record(0, stats(2, 0, 0.125, queries=200, hits=150))
    busy = tracker.snapshot(0xAB, idle=False, status="ready", ts=1.0)
    assert [m.dp_rank for m in busy] == [0, 1]
    m = busy[0]
    assert (m.num_running, m.num_waiting, m.active_decode_blocks, m.total_blocks) == (2, 0, 125, 1000)
    assert m.prefix_hit_rate == pytest.approx(0.5)
    idle = tracker.snapshot(0xAB, idle=True, status="ready", ts=2.0)[0]
    assert (idle.num_running, idle.active_decode_blocks, idle.kv_usage) == (0, 0, 0.0)
    tracker.record(0, stats(0, 0, 0.0, reset=True))
    assert tracker.snapshot(0xAB, idle=True, status="ready", ts=3.0)[0].prefix_hit_rate == 0.0


# -- block table ----------------------------------------------------------------------------------


def stored(parent, pairs, lora=None) -> KvStored:
    return KvStored(parent_hash=parent, blocks=[StoredBlock(h, t) for h, t in pairs], lora_name=lora)


def test_table_mirrors_the_router_index() -> None:
    table, index = KvBlockTable(), KvIndexer()
    events = [
        stored(None, [(1, 11), (2, 12), (3, 13)]),
        stored(2, [(4, 14)]),  # a branch under block 2
        stored(99, [(5, 15)]),  # unknown parent: dropped, as the router drops it
        KvRemoved(block_hashes=[2]),  # drops 2 and its descendants 3, 4
        stored(1, [(6, 16)]),
        stored(None, [(7, 17)], lora="a"),
    ]
    for i, ev in enumerate(events):
        table.apply(0, ev)
        index.apply_event(RouterEvent(worker_id=1, dp_rank=0, event_id=i, event=ev))
    assert table.num_blocks() == 3 == index.tree_size((1, 0))
    rebuilt = KvIndexer()
    for ev in table.dump(worker_id=1, event_id=5):
        rebuilt.apply_event(ev)
    assert rebuilt.tree_size((1, 0)) == 3
    assert rebuilt.find_matches([11, 16]).scores == {(1, 0): 2}
    table.apply(0, KvCleared())
    assert table.num_blocks() == 0 and table.dump(1, 6) == []


def test_dump_sends_chains_parents_first() -> None:
    table = KvBlockTable()
    table.apply(0, stored(None, [(1, 11), (2, 12), (3, 13)]))
    table.apply(0, stored(1, [(4, 14)]))
    table.apply(1, stored(None, [(9, 19)]))
    dump = table.dump(worker_id=7, event_id=3)
    seen: set[int] = set()
    for ev in dump:
        assert ev.event.parent_hash is None or ev.event.parent_hash in seen
        seen.update(b.block_hash for b in ev.event.blocks)
    assert seen == {1, 2, 3, 4, 9} and {ev.dp_rank for ev in dump} == {0, 1}
