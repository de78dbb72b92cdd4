"""The decode worker of a prompt prefilled on it (conditional disaggregation decided local) is chosen
by the predicted time of that prefill there, not by the KV cost (issue 23: members of a bunch of
short prompts piled onto the decode worker with the fewest decode blocks, each waiting there for
the prefill step of the one before it)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.frontend.pipeline.kv_routing import KvGroup, KvModelRouter
from dynamod.daemon.frontend.pipeline.routing import RouteRequest
from dynamod.daemon.router.core import KvRouter, KvRouterConfig, native
from dynamod.daemon.router.core.disagg_cost import (
    CostState,
    MockerCompute,
    TransferEstimate,
    local_on_worker_ms,
    predict,
)
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from dynamod.daemon.router.core.local_choice import LocalPrefillChoice, running_decodes
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.routing import (
    DISAGG_LOCAL,
    DISAGG_REMOTE,
    REASON_LOWEST_COST,
    REASON_LOWEST_LOCAL_MS,
    STAGE_DECODE,
    DisaggInfo,
)

BS = 16
A, B = (0xA, 0), (0xB, 0)
COMPUTE = MockerCompute()

CORES = [pytest.param(None, id="python")]
if native.core is not None:
    CORES.append(pytest.param(native.core, id="native"))


def _prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def _bunch_state(core) -> KvRouter:
    """A holds 4 decode blocks and a short prompt routed there a moment ago (no first token yet);
    B holds 20 decode blocks, nothing queued. The KV cost of a next 2-block prompt: A 4 + 8 = 12
    (prefill 64 tokens, decode 4 + 2 + 2 blocks), B 2 + 22 = 24."""
    kv = KvRouter(KvRouterConfig(), BS, rng=random.Random(0), registry=CollectorRegistry(), core=core)
    kv.update_workers([A, B])
    for rid, worker, prompt in (("a-old", A, _prompt(10_000, 4)), ("b-old", B, _prompt(20_000, 20))):
        kv.select_worker(rid, prompt, allowed=[worker])
        kv.mark_prefill_done(rid)
    kv.select_worker("first", _prompt(30_000, 2), allowed=[A])  # prefilling on A
    return kv


@pytest.mark.parametrize("core", CORES)
def test_a_local_prompt_avoids_the_worker_still_prefilling_the_one_before_it(core):
    kv = _bunch_state(core)
    prompt = _prompt(40_000, 2)
    by_cost = kv.best_worker("next", prompt)
    assert by_cost.worker == A and by_cost.reason == REASON_LOWEST_COST  # what it did before
    local = LocalPrefillChoice(COMPUTE)
    ms = local.predicted_ms(by_cost.candidates, len(prompt), BS, kv.active, kv.busy)
    # A waits out the queued prompt's step first: a whole prefill step more than B.
    assert ms[0] - ms[1] > COMPUTE.prefill_ms(len(prompt))
    decision = kv.select_worker("next", prompt, local_prefill=local)
    assert decision.worker == B
    assert decision.reason == REASON_LOWEST_LOCAL_MS
    assert f"worker {A[0]:016x}" in decision.detail
    assert [c.worker_id for c in decision.candidates] == [A[0], B[0]]  # every candidate still explained


@pytest.mark.parametrize("core", CORES)
def test_with_nothing_queued_ties_keep_the_kv_order(core):
    kv = _bunch_state(core)
    kv.mark_prefill_done("first")
    # Nothing queued anywhere, KV occupancy unknown, the stall not weighed: the same predicted time
    # on both, so the lower KV cost (A) wins.
    decision = kv.select_worker("next", _prompt(40_000, 2), local_prefill=LocalPrefillChoice(COMPUTE, interference_weight=0.0))
    assert decision.worker == A and decision.reason == REASON_LOWEST_LOCAL_MS


def test_queued_work_costs_a_step_of_its_own_not_a_share_of_one():
    # The cost policy's local/remote prediction batches queued work with the prompt (1-2 ms more);
    # choosing among decode workers charges it as the step it most likely is, already under way.
    alone = local_on_worker_ms(COMPUTE, tokens=85, queued_tokens=0, running_decodes=8, kv_fraction=0.0)
    behind = local_on_worker_ms(COMPUTE, tokens=85, queued_tokens=85, running_decodes=8, kv_fraction=0.0)
    assert behind - alone == pytest.approx(COMPUTE.prefill_ms(85) + COMPUTE.decode_step_ms(0.0))
    state = CostState(isl=85, decode_cached_tokens=0, decode_queued_tokens=0, running_decodes=8, decode_kv_fraction=0.0,
                      prefill_cached_tokens=0, prefill_queued_tokens=0)
    # Same terms as the policy's local cost when nothing is queued.
    assert alone == pytest.approx(predict(state, COMPUTE, TransferEstimate()).local_cost_ms, abs=1e-3)


def test_the_policy_offers_the_choice_only_when_conditional():
    assert DisaggPolicyConfig().local_prefill_choice(COMPUTE) is None
    choice = DisaggPolicyConfig(enabled=True, interference_weight=0.5).local_prefill_choice(COMPUTE)
    assert choice == LocalPrefillChoice(COMPUTE, 0.5)


class _Decisions:
    def offer(self, decision: object, model: str) -> None:
        return None


def _inst(worker_id: int) -> Instance:
    return Instance(namespace="ns", component="backend", endpoint="generate", instance_id=worker_id, transport="tcp",
                    address="127.0.0.1:1")


async def test_the_frontend_uses_it_for_the_decode_stage_of_a_local_prompt_only():
    candidates = [_inst(A[0]), _inst(B[0])]
    for mode, expected in ((DISAGG_LOCAL, B), (DISAGG_REMOTE, A)):
        kv = _bunch_state(None)
        router = KvModelRouter(KvGroup("m", kv, 1), None, "m", _Decisions(), LocalPrefillChoice(COMPUTE))  # type: ignore[arg-type]
        info = DisaggInfo(mode=mode, policy="cost", reason="cost_local" if mode == DISAGG_LOCAL else "cost_remote")
        choice = await router.select(
            RouteRequest("next", _prompt(40_000, 2), stage=STAGE_DECODE, disagg=info), candidates
        )
        assert (choice.worker_id, choice.dp_rank) == expected, mode
    agg = await router.select(RouteRequest("agg", _prompt(50_000, 2)), candidates)
    assert agg.explain is not None and agg.explain.reason == REASON_LOWEST_COST


@pytest.mark.parametrize("core", CORES)
def test_a_burst_does_not_pile_onto_a_worker_whose_last_report_says_idle(core):
    """A's streams just ended (its report: nothing running), B reports 6 running. Eight short
    prompts routed local one after another, no first token yet: the ones routed to A decode there
    by the time the next is prefilled, so they count as running there, and the burst spreads."""
    kv = KvRouter(KvRouterConfig(), BS, rng=random.Random(0), registry=CollectorRegistry(), core=core)
    kv.update_workers([A, B])
    kv.apply_load(LoadMetrics(worker_id=A[0], num_running=0, total_blocks=1000))
    kv.apply_load(LoadMetrics(worker_id=B[0], num_running=6, total_blocks=1000))
    local = LocalPrefillChoice(COMPUTE)
    landed = [kv.select_worker(f"s{i}", _prompt(50_000 + 1000 * i, 6), local_prefill=local).worker for i in range(8)]
    assert landed[0] == A  # idle and nothing queued: the cheapest
    assert landed.count(B) >= 2, landed  # the report alone sent all eight to A
    assert running_decodes(kv.active, kv.busy, A) == landed.count(A)
