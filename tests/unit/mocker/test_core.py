"""MockerCore: scheduling, prefix caching, eviction, preemption, outputs and KV events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.shared.errors import ContextLengthError, InvalidRequestError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored
from dynamod.shared.protocol.llm import PreprocessedRequest, SamplingOptions, StopConditions
from tests.unit.mocker.factories import (
    finished_by_request,
    make_config,
    make_core,
    run_to_completion,
    tokens_by_request,
)


def events_of(outs) -> list:
    return [event for out in outs for event in out.kv_events]


def stored_hashes(events) -> list[tuple[int, int]]:
    return [(b.block_hash, b.tokens_hash) for e in events if isinstance(e, KvStored) for b in e.blocks]


# ---- prefix caching and eviction --------------------------------------------------------------


def test_same_long_prompt_twice_reports_cached_tokens_the_second_time():
    core = make_core(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=256)
    prompt = list(range(1, 51))  # 12 full blocks + 2 tokens
    core.add_request("first", prompt, max_tokens=4)
    first = finished_by_request(run_to_completion(core))["first"]
    core.add_request("second", prompt, max_tokens=4)
    outs = run_to_completion(core)
    second = finished_by_request(outs)["second"]
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 48 and second.usage.prompt_tokens == 50
    assert outs[0].num_prefill_tokens == 2  # only the uncached tail costs prefill time
    assert core.load().prefix_hit_rate == pytest.approx(48 / 100)


def test_eviction_under_pressure_emits_removed_events_and_later_misses():
    core = make_core(num_gpu_blocks=8, block_size=4)
    a = list(range(1, 17))  # 4 full blocks
    core.add_request("a", a, max_tokens=1)
    outs = run_to_completion(core)
    _, a_seq = hash_tokens(a, 4)
    assert stored_hashes(events_of(outs)) == list(zip(a_seq, hash_tokens(a, 4)[0], strict=True))

    core.add_request("b", list(range(50, 78)), max_tokens=1)  # 7 blocks: 4 unused + 3 of a's
    outs = run_to_completion(core)
    removed = [e for e in events_of(outs) if isinstance(e, KvRemoved)]
    # a's blocks were freed tail first, so its last three blocks go and its first survives.
    assert removed == [KvRemoved(block_hashes=[a_seq[3], a_seq[2], a_seq[1]])]

    core.add_request("a-again", a, max_tokens=1)
    fin = finished_by_request(run_to_completion(core))["a-again"]
    assert fin.usage.cached_tokens == 4


def test_stored_event_hashes_equal_the_router_hashes_of_the_same_tokens():
    core = make_core(num_gpu_blocks=32, block_size=4)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5]
    core.add_request("r", prompt, max_tokens=7, ignore_eos=True)
    outs = run_to_completion(core)
    all_tokens = prompt + tokens_by_request(outs)["r"]
    assert len(all_tokens) == 17
    # Every token but the last sampled one went through the model: 4 full blocks are cached,
    # including the two made of generated tokens.
    local, seq = hash_tokens(all_tokens[:16], 4)
    events = events_of(outs)
    assert stored_hashes(events) == list(zip(seq, local, strict=True))
    parents = [e.parent_hash for e in events if isinstance(e, KvStored)]
    assert parents[0] is None and all(p in seq for p in parents[1:])


def test_prefix_caching_off_emits_no_events_and_never_hits():
    core = make_core(enable_prefix_caching=False)
    for rid in ("a", "b"):
        core.add_request(rid, list(range(1, 30)), max_tokens=2)
    outs = run_to_completion(core)
    assert events_of(outs) == []
    assert {f.usage.cached_tokens for f in finished_by_request(outs).values()} == {0}


def test_clear_kv_blocks_emits_cleared_and_forgets_the_cache():
    core = make_core()
    prompt = list(range(1, 30))
    core.add_request("a", prompt, max_tokens=1)
    run_to_completion(core)
    assert core.kv_manager.block_pool.num_cached_blocks == 7
    assert core.clear_kv_blocks() == 7
    assert core.take_events() == [KvCleared()]
    assert core.kv_dump() == []
    core.add_request("b", prompt, max_tokens=1)
    assert finished_by_request(run_to_completion(core))["b"].usage.cached_tokens == 0


def test_kv_dump_rebuilds_the_same_view_as_the_event_stream():
    core = make_core(num_gpu_blocks=12, block_size=4)
    view: set[int] = set()
    prompts = [list(range(1, 20)), list(range(1, 12)) + [90, 91, 92, 93], list(range(40, 70))]
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, max_tokens=3, ignore_eos=True)
        for event in events_of(run_to_completion(core)):
            if isinstance(event, KvStored):
                view.update(b.block_hash for b in event.blocks)
            elif isinstance(event, KvRemoved):
                view.difference_update(event.block_hashes)
    dump = core.kv_dump()
    dumped = [b.block_hash for e in dump for b in e.blocks]
    assert set(dumped) == view and len(dumped) == len(view)
    seen: set[int] = set()
    for event in dump:  # parent before child
        assert event.parent_hash is None or event.parent_hash in seen or event.parent_hash not in view
        seen.update(b.block_hash for b in event.blocks)


# ---- scheduling ---------------------------------------------------------------------------------


def test_chunked_prefill_respects_the_token_budget_and_running_requests_go_first():
    core = make_core(num_gpu_blocks=64, max_num_batched_tokens=16)
    core.add_request("short", [1, 2, 3], max_tokens=20, ignore_eos=True)
    core.step()  # short prefilled, now decoding
    core.add_request("long", list(range(1, 41)), max_tokens=2, ignore_eos=True)
    chunks = []
    while "long" not in core.step().req_ids:
        chunks.append(core.scheduler.requests["long"].num_computed_tokens)
    # Each step: 1 token for the decoding request, 15 for the long prompt.
    assert chunks == [15, 30]
    assert core.scheduler.requests["long"].num_computed_tokens == 40


def test_max_num_seqs_caps_the_running_batch():
    core = make_core(num_gpu_blocks=64, max_num_seqs=2)
    for i in range(4):
        core.add_request(f"r{i}", [i + 1] * 5, max_tokens=3, ignore_eos=True)
    out = core.step()
    assert out.num_prefill_reqs == 2
    assert core.load().num_running == 2 and core.load().num_waiting == 2
    run_to_completion(core)


def test_watermark_holds_back_admission_only_while_others_run():
    core = make_core(num_gpu_blocks=10, watermark=0.2)  # 2 blocks kept free for running requests
    core.add_request("a", list(range(1, 25)), max_tokens=4, ignore_eos=True)  # 6 blocks + 1 to grow
    core.step()
    core.add_request("b", list(range(30, 38)), max_tokens=1)  # needs 2 blocks
    core.step()
    # a holds 7 of 10 blocks after its first decode; admitting b would leave 1 < watermark 2.
    assert core.load().num_waiting == 1
    run_to_completion(core)
    # Alone, a request may use the blocks a watermark would keep back.
    core.add_request("big", list(range(1, 40)), max_tokens=1)
    assert core.step().num_prefill_reqs == 1


def test_preemption_under_memory_pressure_completes_every_request():
    core = make_core(num_gpu_blocks=16, block_size=4, max_num_batched_tokens=64)
    for i in range(4):  # each ends at 28 tokens = 7 blocks; four need 28 of 16 blocks
        core.add_request(f"r{i}", [10 + i] * 8, max_tokens=20, ignore_eos=True)
    outs = run_to_completion(core)
    assert sum(out.num_preempted for out in outs) > 0
    finished = finished_by_request(outs)
    produced = tokens_by_request(outs)
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    for rid, fin in finished.items():
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 20
        assert len(produced[rid]) == 20
    assert any(fin.num_preemptions for fin in finished.values())
    pool = core.kv_manager.block_pool
    assert pool.get_num_free_blocks() == 16 and all(b.ref_cnt == 0 for b in pool.blocks)


def test_abort_frees_blocks_wherever_the_request_is():
    core = make_core(num_gpu_blocks=16, max_num_seqs=1)
    core.add_request("running", list(range(1, 20)), max_tokens=20, ignore_eos=True)
    core.add_request("waiting", list(range(1, 20)), max_tokens=20, ignore_eos=True)
    core.step()
    assert core.load().active_blocks == 5
    assert core.abort("waiting") and core.abort("running")
    assert not core.abort("running")
    assert core.load().active_blocks == 0 and not core.has_unfinished_requests()


def test_load_reports_pending_prefill_tokens():
    core = make_core(num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=1)
    core.add_request("a", list(range(1, 41)), max_tokens=2)
    core.add_request("b", list(range(1, 11)), max_tokens=2)
    assert core.load().active_prefill_tokens == 50
    core.step()
    load = core.load()
    assert load.active_prefill_tokens == 34 and load.num_running == 1 and load.num_waiting == 1


def test_kv_transferred_prompt_costs_no_prefill_time():
    core = make_core()
    core.add_request("d", list(range(1, 30)), max_tokens=2, kv_transferred=True)
    out = core.step()
    assert out.num_prefill_tokens == 0 and out.req_ids == ["d"]


# ---- outputs --------------------------------------------------------------------------------------


def test_max_tokens_is_honoured_exactly():
    core = make_core()
    core.add_request("r", [1, 2, 3], max_tokens=5, ignore_eos=True)
    outs = run_to_completion(core)
    assert len(tokens_by_request(outs)["r"]) == 5
    fin = finished_by_request(outs)["r"]
    assert (fin.finish_reason, fin.usage.completion_tokens, fin.usage.prompt_tokens) == ("length", 5, 3)


def test_eos_stops_unless_ignore_eos():
    # A 4-token vocabulary makes EOS (id 3) come up within a few tokens.
    core = make_core(num_gpu_blocks=64, vocab_size=4, eos_token_ids=(3,))
    core.add_request("eos", [0, 1], max_tokens=200)
    core.add_request("ignore", [0, 1], max_tokens=200, ignore_eos=True)
    outs = run_to_completion(core)
    produced, finished = tokens_by_request(outs), finished_by_request(outs)
    assert finished["eos"].finish_reason == "stop" and produced["eos"][-1] == 3
    assert 3 not in produced["eos"][:-1] and len(produced["eos"]) < 200
    assert finished["ignore"].finish_reason == "length" and len(produced["ignore"]) == 200
    assert 3 in produced["ignore"]


def test_stop_token_ids_stop_and_min_tokens_masks_them():
    core = make_core(num_gpu_blocks=64, vocab_size=4)
    core.add_request("stop", [0, 1], max_tokens=200, stop_token_ids=[2])
    core.add_request("min", [0, 1], max_tokens=200, stop_token_ids=[2], min_tokens=30)
    outs = run_to_completion(core)
    produced, finished = tokens_by_request(outs), finished_by_request(outs)
    assert finished["stop"].finish_reason == "stop" and produced["stop"][-1] == 2
    assert 2 not in produced["min"][:30] and len(produced["min"]) > 30
    assert finished["min"].finish_reason == "stop" and produced["min"][-1] == 2


def test_outputs_are_deterministic_for_the_same_seed():
    def run(rid: str, seed: int | None) -> list[int]:
        core = make_core(vocab_size=50_000)
        core.add_request(rid, [5, 6, 7], max_tokens=30, seed=seed, ignore_eos=True)
        return tokens_by_request(run_to_completion(core))[rid]

    assert run("x", 42) == run("y", 42)  # the seed decides, not the request id
    assert run("x", 42) != run("x", 43)
    assert run("x", None) == run("x", None)  # unseeded: derived from the request id
    assert run("x", None) != run("y", None)
    assert all(0 <= t < 50_000 for t in run("x", 1))


def test_prefill_only_request_produces_one_token():
    core = make_core()
    core.add_preprocessed(PreprocessedRequest(request_id="p", model="m", token_ids=[1, 2, 3], prefill_only=True))
    outs = run_to_completion(core)
    assert tokens_by_request(outs)["p"] and len(tokens_by_request(outs)["p"]) == 1


def test_add_preprocessed_maps_the_wire_request():
    core = make_core()
    core.add_preprocessed(
        PreprocessedRequest(
            request_id="w", model="m", token_ids=[1, 2, 3],
            sampling=SamplingOptions(seed=7), stop=StopConditions(max_tokens=4, ignore_eos=True),
        )
    )
    outs = run_to_completion(core)
    assert finished_by_request(outs)["w"].usage.completion_tokens == 4


# ---- validation ------------------------------------------------------------------------------------


def test_prompt_longer_than_the_context_is_rejected_with_the_numbers():
    core = make_core(context_length=32)
    with pytest.raises(ContextLengthError, match="maximum context length is 32.*40 tokens"):
        core.add_request("r", [1] * 40)
    with pytest.raises(ContextLengthError, match=r"requested 40 tokens \(30 in the prompt, 10 for the completion\)"):
        core.add_request("r", [1] * 30, max_tokens=10)
    core.add_request("ok", [1] * 30)  # max_tokens defaults to what is left
    assert core.scheduler.requests["ok"].max_output_tokens == 2


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ([], {}, "empty"),
        ([1, 100], {}, "out of vocabulary"),
        ([1], {"max_tokens": 0}, "max_tokens must be at least 1"),
        ([1], {"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ],
)
def test_invalid_requests_are_rejected(prompt, kwargs, match):
    core = make_core()
    with pytest.raises(InvalidRequestError, match=match):
        core.add_request("r", prompt, **kwargs)
    assert not core.has_unfinished_requests()


def test_duplicate_request_id_is_rejected():
    core = make_core()
    core.add_request("r", [1, 2])
    with pytest.raises(InvalidRequestError, match="already in flight"):
        core.add_request("r", [1, 2])


# ---- property: any workload completes and the events mirror the cache ---------------------------

workloads = st.lists(
    st.tuples(
        st.integers(0, 3),  # shared prefix id
        st.integers(1, 20),  # prompt length
        st.integers(1, 12),  # max_tokens
        st.booleans(),  # abort after a few steps
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, database=None)
@given(workloads, st.integers(8, 20), st.sampled_from([4, 8, 64]))
def test_any_workload_completes_with_consistent_blocks_and_events(workload, num_blocks, budget):
    core = MockerCore(make_config(num_gpu_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4))
    expected: dict[str, int] = {}
    to_abort = []
    for i, (prefix, length, max_tokens, abort) in enumerate(workload):
        rid = f"r{i}"
        core.add_request(rid, [prefix * 10 + j % 7 for j in range(length)], max_tokens=max_tokens, ignore_eos=True)
        (to_abort if abort else []).append(rid)
        expected[rid] = max_tokens
    view: set[int] = set()
    finished = {}
    steps = 0
    pool = core.kv_manager.block_pool
    while core.has_unfinished_requests():
        out = core.step()
        steps += 1
        assert steps < 5000
        if steps == 3:
            for rid in to_abort:
                if core.abort(rid):
                    expected.pop(rid)
        for event in out.kv_events:
            if isinstance(event, KvStored):
                view.update(b.block_hash for b in event.blocks)
            elif isinstance(event, KvRemoved):
                view.difference_update(event.block_hashes)
        for fin in out.finished:
            finished[fin.request_id] = fin.usage.completion_tokens
        # Every block's refcount is the number of live requests holding it.
        holders: dict[int, int] = {}
        for req in core.scheduler.requests.values():
            for block in req.blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in pool.blocks)
        assert view == set(pool.cached_block_hash_to_block)
    assert finished == expected
    assert pool.get_num_free_blocks() == num_blocks
