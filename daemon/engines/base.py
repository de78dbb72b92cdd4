"""The engine interface every backend implements (mocker, vllm, sglang, trtllm).

The worker daemon owns discovery, the request plane and the event plane; an engine only computes.
It reports what its KV cache did through ``kv_events()`` (internal ``RouterEvent``s with a
monotonic ``event_id``) and its load through ``load_metrics()``; the daemon publishes both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from dynamod.daemon.engines.kv_transfer import KvTransferContext
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.embedding import EmbedRequest, EmbedResponse
from dynamod.shared.protocol.kv_events import RouterEvent
from dynamod.shared.protocol.kv_transfer import KvLayout
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import EmbeddingSpec, RuntimeConfig


class EngineState(StrEnum):
    """Where an engine adapter is in its lifecycle; every adapter walks (a part of) this one::

        CREATED --start()--> STARTING --> READY <--sleep() / wake_up()--> SLEEPING
        STARTING, READY, SLEEPING --the engine died--> FAILED
        any state --stop()--> STOPPED

    FAILED and STOPPED are final: ``start()`` refuses them (create a new engine) and ``generate``
    answers ``UnavailableError``. ``status`` properties return one of these.
    A ``StrEnum``, so a state prints and encodes as its word ("ready") in messages and in
    ``LoadMetrics.status``, and compares equal to that word. The mocker has no STARTING or FAILED
    (it starts synchronously and cannot crash); TensorRT-LLM has no STARTING or SLEEPING.
    """

    CREATED = "created"
    STARTING = "starting"
    READY = "ready"
    SLEEPING = "sleeping"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(slots=True)
class LoraInfo:
    name: str
    source: str  # path or URI it was loaded from
    lora_id: int = 0


@dataclass(slots=True)
class EngineInfo:
    """What the daemon publishes in the model card."""

    kv_block_size: int
    context_length: int
    runtime_config: RuntimeConfig
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    embedding: EmbeddingSpec | None = None  # an embedding engine's vector size (known once started)


@runtime_checkable
class Engine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None:
        """Loads the model / starts the step loop. Raises EngineError with a clear message."""
        ...

    def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Streams outputs for one request. Closing the iterator aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def kv_events(self) -> AsyncIterator[RouterEvent]:
        """The engine's KV cache events, in order, each with a monotonic ``event_id``."""
        ...

    def load_metrics(self) -> list[LoadMetrics]:
        """Current load, one entry per data-parallel rank."""
        ...

    async def kv_dump(self) -> list[RouterEvent]:
        """The blocks cached now, as stored events, so a router can rebuild its index."""
        ...

    async def clear_kv_blocks(self, medium: str | None = None) -> int:
        """Drops every cached block not in use, of one KV tier (``medium``: GPU, CPU, DISK as in
        ``kv_events.MEDIA``) or of all (None); emits a cleared event. Returns blocks dropped."""
        ...

    async def sleep(self, level: int) -> None:
        """Level 1: finish nothing new, abort in-flight, release KV memory; level 2: also weights."""
        ...

    async def wake_up(self) -> None: ...

    async def load_lora(self, name: str, source: str) -> LoraInfo: ...

    async def unload_lora(self, name: str) -> None: ...

    def list_loras(self) -> list[LoraInfo]: ...

    @property
    def num_active_requests(self) -> int: ...

    async def stop(self) -> None: ...


@runtime_checkable
class KvTransferEngine(Protocol):
    """An engine whose KV blocks the worker's transfer agent moves (disaggregated serving).

    Optional: the worker checks ``isinstance(engine, KvTransferEngine)``. Engines with their own
    connector (vLLM's NixlConnector, SGLang, TensorRT-LLM) do not implement it and need no change.
    """

    @property
    def kv_layout(self) -> KvLayout | None: ...

    def kv_transfer_memory(self) -> KvBlockMemory | None:
        """The engine's KV blocks as registered memory (None: this engine keeps none)."""
        ...

    def attach_kv_transfer(self, ctx: KvTransferContext) -> None:
        """Called once, after ``start()`` and before ``generate`` is served."""
        ...


@runtime_checkable
class EmbeddingEngine(Protocol):
    """An engine that embeds (``--model-type embedding``): the worker serves ``embed`` with it
    instead of ``generate``. Optional, like ``KvTransferEngine``: the mocker's and vLLM's
    embedding engines implement it; the worker refuses ``--model-type embedding`` otherwise."""

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        """One float32 vector per input, in order (``InvalidRequestError`` for bad dimensions or ids)."""
        ...
