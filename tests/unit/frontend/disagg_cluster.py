"""An in-process disaggregated cluster for the frontend's unit tests (no tests here).

The real frontend (HTTP server, model registry, dispatcher, prefill stage, routers) on the mem
discovery backend, with fake prefill workers (component ``prefill``, a ``prefill`` model card)
that answer with ``disaggregated_params`` as the contract says, and fake decode workers (role
``decode``) that record what they were sent.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dynamod.daemon.frontend.app import build_app
from dynamod.daemon.frontend.http.server import HttpServer, bind_socket
from dynamod.daemon.frontend.main import add_args, prefill_stage_from_args
from dynamod.daemon.frontend.pipeline.dispatch import Dispatcher
from dynamod.daemon.frontend.pipeline.metrics import FrontendMetrics
from dynamod.daemon.frontend.pipeline.models import ModelRegistry
from dynamod.daemon.frontend.pipeline.router_factory import RouterFactoryBuilder
from dynamod.daemon.frontend.pipeline.routing import Quarantine
from dynamod.daemon.frontend.pipeline.state import FrontendConfig, FrontendState
from dynamod.daemon.frontend.pipeline.worker_health import RoutingSync
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import EngineError
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import MODEL_TYPE_PREFILL, ModelCard, encode_card
from dynamod.shared.runtime.distributed import DistributedRuntime, ServedInstance
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.test_app import CONTEXT, Cluster, FakeWorker

BLOCK = 16


@dataclass
class FakePrefill:
    """``mode``: ``ok`` (final frame with params), ``early`` (params first, then runs on until
    ``release``), ``error`` (raises), ``hang`` (never answers), ``no_params`` (finishes without)."""

    lease: Any
    mode: str = "ok"
    cached_tokens: int = 0
    served: ServedInstance | None = None
    requests: list[dict] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hold: asyncio.Event | None = None  # set: an ok prefill waits for it before answering
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # its stream ended or was cancelled

    @property
    def id(self) -> int:
        return self.lease.id

    def params(self, body: dict) -> dict:
        return {"transfer_id": f"t-{body['request_id']}", "worker_id": self.id, "num_tokens": len(body["token_ids"]),
                "block_ids": list(range((len(body["token_ids"]) + BLOCK - 1) // BLOCK)), "cached_tokens": self.cached_tokens}

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.requests.append(body)
        try:
            usage = {"prompt_tokens": len(body["token_ids"]), "cached_tokens": self.cached_tokens, "completion_tokens": 1}
            if self.mode == "error":
                raise EngineError("prefill engine failed (test)")
            if self.mode == "hang":
                await asyncio.Event().wait()
            if self.mode == "no_params":
                yield {"token_ids": [7], "finish_reason": "length", "usage": usage}
                return
            if self.mode == "early":
                yield {"token_ids": [], "disaggregated_params": self.params(body)}
                await self.release.wait()
                yield {"token_ids": [7], "finish_reason": "length", "usage": usage}
                return
            if self.hold is not None:
                await self.hold.wait()
            yield {"token_ids": [7], "finish_reason": "length", "usage": usage, "disaggregated_params": self.params(body)}
        finally:
            self.closed.set()


W = TypeVar("W", FakeWorker, FakePrefill)


class DisaggCluster:
    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.store = MemStore()
        self.rt: DistributedRuntime | None = None
        self.server: HttpServer | None = None
        self.state: FrontendState | None = None
        self.routers: RouterFactoryBuilder | None = None
        self.sync: RoutingSync | None = None
        self.url = ""

    async def start(self) -> None:
        parser = argparse.ArgumentParser()
        add_args(parser)
        args = parser.parse_args(["--http-port", "0", *self.flags])
        settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", lease_ttl_s=5.0)
        self.rt = await DistributedRuntime.create(settings, store=self.store, events=False)
        metrics = FrontendMetrics(self.rt.registry)
        quarantine = Quarantine(hold_s=6.0)
        self.sync = RoutingSync(self.rt, quarantine)
        self.routers = RouterFactoryBuilder(args.router_mode, args, self.rt, self.sync)
        registry = ModelRegistry(self.rt, metrics, quarantine, self.routers.build, self.routers.build_prefill)
        self.routers.attach(registry)
        dispatcher = Dispatcher(
            registry, quarantine, migration_limit=3, worker_wait_s=1.0, prefill_stage=prefill_stage_from_args(args, metrics.disagg)
        )
        config = FrontendConfig(http_port=0, worker_wait_s=1.0, shutdown_grace_s=5.0, router_mode=args.router_mode)
        self.state = FrontendState(config=config, registry=registry, dispatcher=dispatcher, metrics=metrics)
        await self.routers.start()
        await registry.start()
        self.server = HttpServer(build_app(self.state), bind_socket("127.0.0.1", 0), graceful_s=2.0)
        await self.server.start()
        self.url = f"http://127.0.0.1:{self.server.port}"

    def _card(self, model: str, prefill: bool) -> ModelCard:
        card = ModelCard(served_model_name=model, tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT,
                         kv_block_size=BLOCK)
        if prefill:
            card.model_types = [MODEL_TYPE_PREFILL]
        return card

    async def add_decode(self, model: str = "tiny", **kw: Any) -> FakeWorker:
        return await self._add(FakeWorker, "backend", model, **kw)

    async def add_prefill(self, model: str = "tiny", **kw: Any) -> FakePrefill:
        return await self._add(FakePrefill, "prefill", model, **kw)

    async def _add(self, kind: Callable[..., W], component: str, model: str, **kw: Any) -> W:
        """A fake worker of ``kind`` with its own lease, card and ``generate`` endpoint in ``component``
        (``prefill``: a prefill worker, else a decode one), returned once the frontend has it ready."""
        assert self.rt is not None
        prefill = component == "prefill"
        lease = await self.rt.create_lease()
        worker = kind(lease, **kw)
        await self.store.put(mdc_key("dynamo", component, "generate", lease.id), encode_card(self._card(model, prefill)), lease)
        worker.served = await self.rt.namespace().component(component).endpoint("generate").serve(
            worker.handler, lease=lease, model=model, role="prefill" if prefill else "decode"
        )
        ready = self.prefill_ready if prefill else self.ready
        await self.wait(lambda: ready(model, lease.id))
        return worker

    def ready(self, model: str, wid: int) -> bool:
        assert self.state is not None
        m = self.state.registry.models.get(model)
        inst = None if m is None or wid not in m.workers else m.workers[wid].instances.get(wid)
        return inst is not None and inst.status == "ready"

    def prefill_ready(self, model: str, wid: int) -> bool:
        assert self.state is not None
        pool = self.state.registry.prefill_pools.get(model)
        return pool is not None and any(i.instance_id == wid for i in pool.candidates(Quarantine(0)))

    wait = Cluster.wait  # the same deadline-bound poll as the aggregated test cluster

    async def stop(self) -> None:
        if self.server:
            await self.server.stop()
        if self.state:
            await self.state.registry.close()
        if self.routers:
            await self.routers.close()
        if self.rt:
            await self.rt.shutdown(grace_s=0.5)
