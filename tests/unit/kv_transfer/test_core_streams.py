"""The mocker core's streamed holds (``enable_hold_streaming``): a held prefill gets its whole
prompt's blocks at admission and is reported once with its rows; its chunks join the prefix cache
only as they are computed; a streamed hold that is preempted is reported failed and ends as a
plain prefill (no hold that nobody would read)."""

from __future__ import annotations

from dynamod.daemon.engines.mocker.core import MockerCore
from tests.unit.mocker.factories import make_config


def _core(**overrides) -> MockerCore:
    core = MockerCore(make_config(**overrides))
    core.enable_hold_streaming()
    return core


def test_a_held_prompt_is_allocated_whole_and_opened_once() -> None:
    core = _core(max_num_batched_tokens=8)
    core.add_request("p", list(range(1, 31)), max_tokens=1, hold_kv=True)  # 8 blocks, 4 chunks
    out = core.step()
    assert out.streams_opened is not None and len(out.streams_opened) == 1
    hold = out.streams_opened[0]
    assert len(hold.block_ids) == 8 and hold.num_tokens == 30 and hold.cached_tokens == 0
    request = core.scheduler.requests["p"]
    assert len(request.blocks) == 8 and request.num_cached_blocks == 2  # cached: only what is computed
    opened = [hold.transfer_id]
    finished = None
    while finished is None:
        out = core.step()
        assert out.streams_opened is None
        if out.finished:
            finished = out.finished[0]
    assert finished.hold is not None and finished.hold.transfer_id == opened[0]
    assert finished.hold.block_ids == hold.block_ids


def test_a_preempted_streamed_hold_fails_and_is_recomputed_without_a_hold() -> None:
    # 13 blocks of 4 tokens: a growing decode (A) and a 40-token held prefill (B, 10 blocks)
    # fill them; when A needs a block, B (the newest) is preempted mid-prefill.
    core = _core(num_gpu_blocks=13, max_num_batched_tokens=8)
    core.add_request("a", list(range(1, 9)), max_tokens=30, ignore_eos=True)
    core.add_request("b", list(range(50, 90)), max_tokens=1, hold_kv=True)
    opened, failed, finished = [], [], {}
    for _ in range(200):
        out = core.step()
        opened += out.streams_opened or []
        failed += out.streams_failed or []
        for fin in out.finished:
            finished[fin.request_id] = fin
        if len(finished) == 2:
            break
    assert [h.request_id for h in opened] == ["b"]
    assert failed == [(opened[0].transfer_id, "its prefill was preempted on the prefill worker")]
    assert finished["b"].hold is None and finished["b"].num_preemptions >= 1
    assert core.num_held_blocks == 0 and not core.holds
