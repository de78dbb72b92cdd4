"""The standalone router role's prefill/decode routing, in-process with fake workers (mem discovery):
``generate`` runs the shared prefill stage, then forwards to a decode worker with the transfer
parameters; ``best_worker_id`` answers for either stage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.daemon.router.core.config import KvRouterConfig
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from dynamod.daemon.router.core.prefill_stage import DisaggMetrics, PrefillStage
from dynamod.daemon.router.service import RouterService, RouterServiceConfig
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions
from dynamod.shared.protocol.model_card import MODEL_TYPE_PREFILL, ModelCard, encode_card
from dynamod.shared.protocol.routing import STAGE_DECODE, STAGE_PREFILL, RoutingDecision
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.unit.frontend.disagg_cluster import BLOCK, FakePrefill
from tests.unit.frontend.test_app import FakeWorker

PROMPT = list(range(1, 70))


class RouterCluster:
    def __init__(self, policy: DisaggPolicyConfig) -> None:
        self.store = MemStore()
        self.policy = policy
        self.rt: DistributedRuntime | None = None
        self.service: RouterService | None = None
        self.offered: list[RoutingDecision] = []

    async def start(self) -> None:
        settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", lease_ttl_s=5.0)
        self.rt = await DistributedRuntime.create(settings, store=self.store, events=False)
        stage = PrefillStage(self.policy, DisaggMetrics(self.rt.registry, "dynamo_router"), prefill_timeout_s=1.0)
        self.service = RouterService(self.rt, KvRouterConfig(use_kv_events=False), RouterServiceConfig(worker_wait_s=1.0), stage)
        self.service.decisions.offer = lambda d, model="": self.offered.append(d)  # type: ignore[method-assign]
        await self.service.start()

    async def add(self, component: str, worker: Any, role: str) -> None:
        assert self.rt is not None
        card = ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR), context_length=512, kv_block_size=BLOCK)
        if component == "prefill":
            card.model_types = [MODEL_TYPE_PREFILL]
        await self.store.put(mdc_key("dynamo", component, "generate", worker.lease.id), encode_card(card), worker.lease)
        worker.served = await self.rt.namespace().component(component).endpoint("generate").serve(
            worker.handler, lease=worker.lease, model="tiny", role=role
        )

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop(0.5)
        if self.rt is not None:
            await self.rt.shutdown(grace_s=0.5)


async def _lease(c: RouterCluster) -> Any:
    assert c.rt is not None
    return await c.rt.create_lease()


async def _generate(c: RouterCluster) -> list[dict]:
    assert c.rt is not None and c.service is not None
    await c.service._wait_for_workers()
    request = PreprocessedRequest(request_id="r1", model="tiny", token_ids=PROMPT, stop=StopConditions(max_tokens=3))
    return await _call(c, "generate", request)


async def _call(c: RouterCluster, endpoint: str, body: Any) -> list[dict]:
    """Through the request plane, as a frontend or another router would call it."""
    assert c.rt is not None
    client = await c.rt.namespace().component("router").endpoint(endpoint).client()
    try:
        await client.wait_for_instances(1, timeout=5)
        return [out async for out in client.generate(body)]
    finally:
        await client.close()


@pytest.fixture
async def cluster() -> AsyncIterator[RouterCluster]:
    c = RouterCluster(DisaggPolicyConfig())
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


async def test_generate_prefills_remotely_then_decodes_with_params(cluster: RouterCluster) -> None:
    decode = FakeWorker(await _lease(cluster))
    prefill = FakePrefill(await _lease(cluster), cached_tokens=16)
    await cluster.add("backend", decode, "decode")
    await cluster.add("prefill", prefill, "prefill")
    assert cluster.service is not None and cluster.service.prefill is not None
    await _wait(lambda: cluster.service.prefill.routable())  # type: ignore[union-attr]
    outs = await _generate(cluster)
    assert outs[0]["worker_id"] == decode.id and outs[0]["prefill_worker_id"] == prefill.id
    assert outs[0]["disagg"]["mode"] == "remote" and outs[-1]["usage"]["cached_tokens"] == 16
    assert prefill.requests[0]["prefill_only"] is True and prefill.requests[0]["stop"]["max_tokens"] == 1
    assert decode.requests[0]["disaggregated_params"] == prefill.params(prefill.requests[0])
    stages = {d.stage: d for d in cluster.offered}
    assert stages[STAGE_PREFILL].worker_id == prefill.id
    # The remote prompt's decode stage keeps the router's cache credit (blocks cached there do
    # not travel): DisaggPolicyConfig.remote_decode_overlap_weight None.
    assert stages[STAGE_DECODE].overlap_weight == 1.0 and stages[STAGE_DECODE].disagg is not None


async def test_generate_without_prefill_workers_prefills_locally_on_a_decode_worker(cluster: RouterCluster) -> None:
    decode = FakeWorker(await _lease(cluster))
    await cluster.add("backend", decode, "decode")
    outs = await _generate(cluster)
    assert outs[0]["disagg"]["reason"] == "no_prefill_workers" and "disaggregated_params" not in decode.requests[0]


async def test_a_local_prompt_decode_worker_is_chosen_by_predicted_time() -> None:
    # Conditional disaggregation keeps the prompt local (no prefill worker): the decode stage ranks
    # the decode workers by the prompt's predicted prefill time there (local_choice.py).
    c = RouterCluster(DisaggPolicyConfig(enabled=True))
    await c.start()
    try:
        for _ in range(2):
            await c.add("backend", FakeWorker(await _lease(c)), "decode")
        assert c.service is not None
        await _wait(lambda: c.service.kv is not None and len(c.service.kv.workers) == 2)  # type: ignore[union-attr]
        outs = await _generate(c)
        assert outs[0]["disagg"]["mode"] == "local"
        decode = [d for d in c.offered if d.stage == STAGE_DECODE]
        assert decode and decode[0].reason == "lowest_local_ms" and len(decode[0].candidates) == 2
    finally:
        await c.stop()


async def test_best_worker_id_answers_per_stage(cluster: RouterCluster) -> None:
    decode = FakeWorker(await _lease(cluster))
    prefill = FakePrefill(await _lease(cluster))
    await cluster.add("backend", decode, "decode")
    await cluster.add("prefill", prefill, "prefill")
    assert cluster.service is not None
    await _wait(lambda: cluster.service.prefill.routable())  # type: ignore[union-attr]
    async def ask(stage: str) -> dict:
        return (await _call(cluster, "best_worker_id", {"token_ids": PROMPT, "stage": stage}))[0]

    pre = await ask(STAGE_PREFILL)
    dec = await ask(STAGE_DECODE)
    assert pre["worker_id"] == prefill.id and pre["explain"]["stage"] == STAGE_PREFILL
    assert dec["worker_id"] == decode.id and dec["explain"]["stage"] == STAGE_DECODE
    assert dec["explain"]["overlap_weight"] == 1.0  # the policy keeps the router's cache credit for remote prompts
    assert not prefill.requests and not decode.requests  # asking routes nothing


async def _wait(predicate: Any, timeout: float = 5.0) -> None:
    import asyncio

    async def poll() -> None:
        while not predicate():  # noqa: ASYNC110 - a condition with a deadline, polled
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)
