"""The mocker's ``--scheduling-policy priority``, as vLLM's v1 scheduler: waiting requests are
admitted by (priority, arrival), and when memory runs out the least urgent running request is
preempted, even one already scheduled this step. Priorities reach the core in Dynamo's polarity
(higher is more urgent) and are flipped to vLLM's (lower first) at the door."""

from __future__ import annotations

import argparse

import pytest

import dynamod.daemon.engines.mocker.scheduler as scheduler_module
from dynamod.daemon.engines.mocker.config import (
    MockerConfig,
    MockerConfigError,
    add_mocker_args,
    config_from_args,
)
from dynamod.daemon.engines.mocker.request import MockRequest, RequestStatus
from dynamod.daemon.engines.mocker.request_queue import PriorityRequestQueue
from dynamod.shared.protocol.llm import PreprocessedRequest, RoutingHints, StopConditions
from tests.unit.mocker.factories import finished_by_request, make_core, run_to_completion, tokens_by_request


def _dynamo_request(rid: str, token: int, priority: int | None, max_tokens: int = 4) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=[token] * 8,
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        routing=None if priority is None else RoutingHints(priority=priority),
    )


def _finish_order(policy: str) -> list[str]:
    core = make_core(max_num_seqs=1, scheduling_policy=policy)
    for rid, token, priority in (("background", 10, -5), ("unset", 11, None), ("urgent", 12, 7), ("normal", 13, 0)):
        core.add_preprocessed(_dynamo_request(rid, token, priority))
    return [f.request_id for out in run_to_completion(core) for f in out.finished]


def test_priority_policy_admits_the_most_urgent_first_fifo_among_equals():
    assert _finish_order("priority") == ["urgent", "unset", "normal", "background"]


def test_fcfs_policy_ignores_priorities():
    assert _finish_order("fcfs") == ["background", "unset", "urgent", "normal"]


def _memory_race(policy: str, urgent_prompt: int, unscheduled: list[int]) -> tuple[dict, list[str]]:
    """A background request runs; an urgent one joins; together they outgrow the 8-block cache.
    Returns each request's (preemptions, tokens produced) and the finish order. Checks on every
    step that no request produced a token in the step that preempted it."""
    core = make_core(num_gpu_blocks=8, block_size=4, scheduling_policy=policy)
    core.add_preprocessed(_dynamo_request("background", 10, -5, max_tokens=20))
    outs = [core.step()]
    core.add_preprocessed(PreprocessedRequest(
        request_id="urgent", model="m", token_ids=[20] * urgent_prompt,
        stop=StopConditions(max_tokens=20, ignore_eos=True), routing=RoutingHints(priority=5),
    ))
    while core.has_unfinished_requests():
        out = core.step()
        outs.append(out)
        for rid in out.req_ids:
            request = core.scheduler.requests.get(rid)
            assert request is None or request.status != RequestStatus.PREEMPTED, f"{rid} sampled while preempted"
    finished = finished_by_request(outs)
    produced = tokens_by_request(outs)
    pool = core.kv_manager.block_pool
    assert pool.get_num_free_blocks() == 8 and all(b.ref_cnt == 0 for b in pool.blocks)
    stats = {rid: (fin.num_preemptions, len(produced[rid])) for rid, fin in finished.items()}
    return stats, [f.request_id for out in outs for f in out.finished]


@pytest.fixture
def unscheduled(monkeypatch) -> list[int]:
    """Counts the preemptions of a request already scheduled in the step (its tokens given back)."""
    calls: list[int] = []
    original = scheduler_module._unschedule

    def counting(out, request):
        tokens = original(out, request)
        calls.append(tokens)
        return tokens

    monkeypatch.setattr(scheduler_module, "_unschedule", counting)
    return calls


@pytest.mark.parametrize("urgent_prompt", [6, 10])
def test_priority_policy_preempts_the_least_urgent(urgent_prompt, unscheduled):
    stats, order = _memory_race("priority", urgent_prompt, unscheduled)
    assert stats["urgent"] == (0, 20)  # never loses its blocks
    assert stats["background"][0] >= 1 and stats["background"][1] == 20
    assert order == ["urgent", "background"]
    if urgent_prompt == 10:
        # Here the background request, ahead in the running list, was already in the step's batch
        # when the urgent one could not grow: it is taken out of the batch and its token returned.
        assert unscheduled == [1]


def test_fcfs_policy_preempts_the_newest_whatever_its_priority(unscheduled):
    stats, order = _memory_race("fcfs", 10, unscheduled)
    assert stats["urgent"][0] >= 1 and stats["background"] == (0, 20)
    assert order == ["background", "urgent"]
    assert unscheduled == []


def test_priority_queue_orders_by_priority_then_arrival_and_puts_back_by_key():
    queue = PriorityRequestQueue()
    made = {}
    for arrival, (rid, priority) in enumerate((("a", 0), ("b", -1), ("c", 0), ("d", 3))):
        r = MockRequest(rid, [1, 2], max_output_tokens=1, vocab_size=10, priority=priority)
        r.arrival = arrival
        made[rid] = r
        queue.append(r)
    assert [r.request_id for r in queue.in_order()] == ["b", "a", "c", "d"] and queue[0] is made["b"]
    assert queue.popleft() is made["b"]
    queue.appendleft(made["b"])  # a preempted request takes its place by key, here the head again
    queue.remove(made["a"])
    assert [r.request_id for r in queue.in_order()] == ["b", "c", "d"] and len(queue) == 3
    with pytest.raises(ValueError):
        queue.remove(made["a"])


def test_scheduling_policy_flag():
    parser = argparse.ArgumentParser()
    add_mocker_args(parser)
    assert config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    assert config_from_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lottery"])
    with pytest.raises(MockerConfigError, match="--scheduling-policy"):
        MockerConfig(scheduling_policy="lottery")
