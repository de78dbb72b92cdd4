"""MockerCore's disaggregation state: block contents, holds, the remote-KV wait and its fallback."""

from __future__ import annotations

import numpy as np

from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.engines.mocker.request import RequestStatus
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_events import KvStored
from dynamod.shared.protocol.kv_transfer import KvLayout, KvTransferParams
from tests.unit.mocker.factories import finished_by_request, make_config, run_to_completion, tokens_by_request

BS = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2, block_size=BS)  # 32 B/token


def kv_core(dp_rank: int = 0, **overrides) -> tuple[MockerCore, KvBlockMemory]:
    config = make_config(**overrides)
    memory = KvBlockMemory(config.num_gpu_blocks * (dp_rank + 1), LAYOUT.block_bytes)
    return MockerCore(config, dp_rank, kv_memory=memory, kv_layout=LAYOUT), memory


def prefill_and_hold(core: MockerCore, rid: str, prompt: list[int]):
    core.add_request(rid, prompt, max_tokens=1, ignore_eos=True, hold_kv=True)
    [fin] = [f for out in run_to_completion(core) for f in out.finished]
    assert fin.hold is not None
    return fin.hold


def params_from(hold, memory: KvBlockMemory) -> KvTransferParams:
    return KvTransferParams(
        transfer_id=hold.transfer_id, worker_id=1, block_ids=hold.block_ids, block_hashes=hold.block_hashes,
        num_tokens=hold.num_tokens, first_token=hold.first_token, checksum=memory.checksum(hold.block_ids),
    )


# ---- block contents ---------------------------------------------------------------------------


def test_block_bytes_depend_only_on_the_tokens_and_their_prefix():
    prompt = list(range(10, 24))  # 3 full blocks + 2 tokens
    a, mem_a = kv_core()
    b, mem_b = kv_core(dp_rank=1)  # another worker, another rank: other rows, same bytes
    b.add_request("warm", [90, 91, 92, 93, 94], max_tokens=1)  # shifts b's block ids
    run_to_completion(b)
    hold_a = prefill_and_hold(a, "x", prompt)
    hold_b = prefill_and_hold(b, "x", prompt)
    assert hold_a.block_ids != hold_b.block_ids and min(hold_b.block_ids) >= 16  # rank 1: rows 16..31
    assert mem_a.checksum(hold_a.block_ids) == mem_b.checksum(hold_b.block_ids)
    assert mem_a.array[hold_a.block_ids].any()  # bytes were written

    c, mem_c = kv_core()
    other = prompt[:8] + [77] + prompt[9:]  # differs inside block 2
    hold_c = prefill_and_hold(c, "y", other)
    rows_a, rows_c = mem_a.array[hold_a.block_ids], mem_c.array[hold_c.block_ids]
    assert np.array_equal(rows_a[:2], rows_c[:2])  # shared prefix, same bytes
    assert not np.array_equal(rows_a[2], rows_c[2]) and not np.array_equal(rows_a[3], rows_c[3])  # KV after it differs


def test_chunked_prefill_writes_the_same_bytes_as_one_pass():
    prompt = list(range(1, 31))
    whole, mem_whole = kv_core(max_num_batched_tokens=64)
    chunked, mem_chunked = kv_core(max_num_batched_tokens=7)  # chunks split blocks mid-way
    h1 = prefill_and_hold(whole, "r", prompt)
    h2 = prefill_and_hold(chunked, "r", prompt)
    assert mem_whole.checksum(h1.block_ids) == mem_chunked.checksum(h2.block_ids)


def test_an_aggregated_core_keeps_no_bytes():
    core = MockerCore(make_config())
    assert core.kv_writer is None


# ---- holds ------------------------------------------------------------------------------------


def test_held_blocks_stay_referenced_until_released():
    core, _ = kv_core()
    hold = prefill_and_hold(core, "p", list(range(1, 11)))  # 3 blocks
    assert len(hold.blocks) == 3 and hold.num_tokens == 10 and len(hold.block_hashes) == 2
    assert core.load().held_blocks == 3 and core.load().active_blocks == 3
    assert core.release_hold(hold.transfer_id) is hold
    assert core.release_hold(hold.transfer_id) is None  # a second notification is harmless
    load = core.load()
    assert load.held_blocks == 0 and load.active_blocks == 0


def test_clear_kv_blocks_releases_holds():
    core, _ = kv_core()
    prefill_and_hold(core, "p", list(range(1, 11)))
    core.clear_kv_blocks()
    assert core.holds == {} and core.load().active_blocks == 0


# ---- the remote-KV path -----------------------------------------------------------------------


def test_remote_request_waits_for_its_kv_then_decodes_without_prefill():
    prefill_core, prefill_mem = kv_core()
    prompt = list(range(1, 15))  # 3 full blocks + 2
    params = params_from(prefill_and_hold(prefill_core, "r", prompt), prefill_mem)

    core, _ = kv_core()
    core.add_request("r", prompt, max_tokens=3, ignore_eos=True, remote=params)
    out = core.step()
    [load] = out.remote_loads
    assert load.num_local_hits == 0 and len(load.local_block_ids) == 4 and load.num_tokens == 14
    assert out.req_ids == [] and out.duration_ms == 0.0
    assert core.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert core.step().req_ids == []  # not schedulable while its blocks are being read
    assert not [e for e in out.kv_events if isinstance(e, KvStored)]  # not cached before it arrived

    assert core.finish_remote_load("r", ok=True)
    stored = [b.block_hash for e in core.take_events() if isinstance(e, KvStored) for b in e.blocks]
    assert stored == params.block_hashes
    first = core.step()
    # Only the last prompt token is computed here, in a decode slot (vLLM recomputes it).
    assert first.req_ids == ["r"] and first.num_prefill_tokens == 0 and first.decode_ms > 0
    outs = [first, *run_to_completion(core)]
    fin = finished_by_request(outs)["r"]
    assert fin.usage.completion_tokens == 3 and fin.usage.prompt_tokens == 14
    # The same request id and prompt sample the prefill's first token.
    assert tokens_by_request(outs)["r"][0] == params.first_token


def test_remote_request_reads_only_what_it_does_not_cache():
    prompt = list(range(1, 15))
    prefill_core, prefill_mem = kv_core()
    params = params_from(prefill_and_hold(prefill_core, "r", prompt), prefill_mem)
    core, mem = kv_core()
    core.add_request("warm", prompt[:9], max_tokens=1)  # caches blocks 0 and 1
    run_to_completion(core)
    core.add_request("r", prompt, max_tokens=2, remote=params)
    [load] = core.step().remote_loads
    assert load.num_local_hits == 2
    # The local hits already hold the bytes the prefill worker computed for those blocks.
    assert mem.checksum(load.local_block_ids[:2]) == prefill_mem.checksum(params.block_ids[:2])


def test_failed_load_falls_back_to_local_prefill():
    prompt = list(range(1, 15))
    core, _ = kv_core()
    params = KvTransferParams(transfer_id="t", worker_id=9, block_ids=[0, 1, 2, 3], num_tokens=14)
    core.add_request("r", prompt, max_tokens=2, ignore_eos=True, remote=params)
    core.step()
    assert core.load().num_loading == 1
    assert core.finish_remote_load("r", ok=False)
    assert core.load().active_blocks == 0  # the unfilled blocks went back to the pool
    out = core.step()
    assert out.num_prefill_tokens == 14 and out.req_ids == ["r"]
    fin = finished_by_request([out, *run_to_completion(core)])["r"]
    assert fin.usage.completion_tokens == 2


def test_abort_while_loading_frees_blocks_when_the_read_ends():
    core, _ = kv_core()
    params = KvTransferParams(transfer_id="t", worker_id=9, block_ids=[0, 1, 2], num_tokens=10)
    core.add_request("r", list(range(1, 11)), max_tokens=2, remote=params)
    core.step()
    assert core.abort("r")
    assert core.load().active_blocks == 3  # the read may still be writing into them
    assert not core.finish_remote_load("r", ok=True)
    assert core.load().active_blocks == 0 and not core.has_unfinished_requests()


def test_preempted_transferred_request_is_recomputed_locally():
    prompt = list(range(1, 13))  # 3 full blocks
    prefill_core, prefill_mem = kv_core(num_gpu_blocks=8)
    params = params_from(prefill_and_hold(prefill_core, "r", prompt), prefill_mem)
    core, _ = kv_core(num_gpu_blocks=8, max_num_batched_tokens=64)
    core.add_request("big", list(range(40, 56)), max_tokens=14, ignore_eos=True)  # 4 blocks, grows
    core.step()
    core.add_request("r", prompt, max_tokens=6, ignore_eos=True, remote=params)
    core.step()  # big takes a 5th block, r the last 3
    assert core.finish_remote_load("r", ok=True)
    assert core.step().num_prefill_tokens == 0  # r's last prompt token, in a decode slot
    r = core.scheduler.requests["r"]
    outs = []
    while r.num_preemptions == 0:
        outs.append(core.step())  # r, the newest, is preempted when it needs a 4th block
    assert not r.kv_transferred and r.num_computed_tokens == 0
    outs += run_to_completion(core)
    # Its whole prompt and its first token are prefilled here: the transferred KV does not come back.
    assert sum(o.num_prefill_tokens for o in outs) >= len(prompt) + 1
    fin = finished_by_request(outs)
    assert fin["r"].usage.completion_tokens == 6 and fin["big"].usage.completion_tokens == 14


def test_decode_step_time_leaves_out_blocks_still_waiting_for_their_kv():
    """A remote request's blocks are allocated when it is admitted, while its KV is still read
    (with the transfer overlapped, for the whole remote prefill); no step attends them until they
    land, so the running decodes' steps must not slow down for them (a trace replay adds such a
    request only when its transfer ends)."""
    from dynamod.daemon.perf.mocker_timing import decode_time_ms

    n = 32
    core, _ = kv_core(num_gpu_blocks=n)
    core.add_request("running", list(range(60, 66)), max_tokens=20, ignore_eos=True)
    running = core.scheduler.requests["running"]

    def attended(*extra: int) -> float:  # the step time of "running"'s blocks (plus ``extra``)
        return decode_time_ms((len(running.blocks) + sum(extra)) / n)

    core.step()  # its prefill
    assert core.step().decode_ms == attended()
    prompt = list(range(60, 64)) + list(range(1, 31))  # its first block is cached and used by "running"
    core.add_request("remote", prompt, max_tokens=2,
                     remote=KvTransferParams(transfer_id="t", worker_id=9, block_ids=list(range(9)), num_tokens=34))
    waiting = core.step()
    assert waiting.remote_loads and waiting.kv_usage == (len(running.blocks) + 8) / n  # held...
    assert waiting.decode_ms == attended()  # ...but only "running"'s blocks are attended
    core.add_request("also-remote", prompt, max_tokens=2,
                     remote=KvTransferParams(transfer_id="u", worker_id=9, block_ids=list(range(9)), num_tokens=34))
    assert core.step().decode_ms == attended()
    assert core.abort("also-remote")  # its read may still write into its blocks: held, not attended
    assert core.step().decode_ms == attended()
    assert core.finish_remote_load("remote", ok=True)
    assert core.finish_remote_load("also-remote", ok=True) is False  # its blocks go back now
    assert core.step().decode_ms == attended(8)  # landed and decoding: attended
