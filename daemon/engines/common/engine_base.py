"""What every native-engine adapter (vLLM, SGLang, TensorRT-LLM) keeps the same way.

The three adapters differ in how they drive their engine, not in their bookkeeping: each is one
worker with a model, a role, an ``EngineInfo`` it refines once the engine started, a lifecycle
``EngineState``, the requests in flight, the LoRA adapters it loaded (numbered from 1 as the
engines want) and a ``NativeKvEventQueue`` that turns the engine's KV events into router events.
``NativeEngineBase`` holds that state and the Engine-protocol members that only read it, so an
adapter's module says what is particular to its engine. ``request_errors`` is the one place an
engine's exception for a failed request becomes ours.

``EngineBookkeeping``, below it, is the part the mocker keeps the same way too (its info and
lifecycle state, the requests in flight, the LoRA adapters by name): the mocker simulates its KV
events and its lifecycle itself, so it takes only that.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from dynamod.daemon.engines.base import EngineInfo, EngineState, LoraInfo
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER, NativeKvEventQueue
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.errors import DynamoError, EngineError, InvalidRequestError, NotFoundError
from dynamod.shared.protocol.kv_events import KvCleared, RouterEvent
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest


def engine_request_error(engine: str, exc: Exception) -> DynamoError:
    """An engine's exception for one request as ours: a ``ValueError`` is the client's input."""
    if isinstance(exc, ValueError):
        return InvalidRequestError(str(exc))
    return EngineError(f"{engine} request failed: {type(exc).__name__}: {exc}")


@contextmanager
def request_errors(translate: Callable[[Exception], DynamoError]) -> Iterator[None]:
    """Around an engine's request stream: our own errors, cancellation and the stream's close pass
    through; anything else the engine raised becomes ``translate(exc)``."""
    try:
        yield
    except (GeneratorExit, asyncio.CancelledError, DynamoError):
        raise
    except Exception as exc:
        raise translate(exc) from exc


class EngineBookkeeping:
    """What every engine (native or mocker) keeps the same way: its ``EngineInfo``, lifecycle
    state, requests in flight and loaded LoRA adapters, with the Engine members that read them."""

    ENGINE_NAME: ClassVar[str] = "engine"  # as the engine's users know it, for messages

    def __init__(self, worker_id: int, info: EngineInfo) -> None:
        self.worker_id = worker_id
        self._info = info
        self._status = EngineState.CREATED
        self._active: dict[str, Any] = {}  # request id -> the engine's per-request handle
        self._loras: dict[str, LoraInfo] = {}
        self._next_lora_id = 1

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def status(self) -> EngineState:
        return self._status

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    def _check_new_request(self, rid: str) -> None:
        if rid in self._active:
            raise InvalidRequestError(f"request id {rid!r} is already in flight", param="request_id")

    # ---- LoRA ----------------------------------------------------------------------------------

    def _request_lora(self, name: str) -> LoraInfo:
        """The loaded adapter a request names (its ``lora_name``)."""
        lora = self._loras.get(name)
        if lora is None:
            loaded = ", ".join(sorted(self._loras)) or "none"
            raise InvalidRequestError(
                f"LoRA adapter {name!r} is not loaded on this worker (loaded: {loaded})", param="model"
            )
        return lora

    def _loaded_lora(self, name: str, path: str) -> LoraInfo | None:
        """The adapter already loaded as ``name`` from ``path`` (loading it again is a no-op), or
        None when ``name`` is free; a name taken by another source is refused."""
        existing = self._loras.get(name)
        if existing is not None and existing.source != path:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} is already loaded from {existing.source!r}; unload it first", param="lora_name"
            )
        return existing

    def _new_lora(self, name: str, path: str) -> LoraInfo:
        """The next adapter id for ``name`` (registered in ``_loras`` once the engine took it)."""
        info = LoraInfo(name=name, source=path, lora_id=self._next_lora_id)
        self._next_lora_id += 1
        return info

    def _unknown_lora(self, name: str) -> NotFoundError:
        return NotFoundError(f"LoRA adapter {name!r} is not loaded on worker {self.worker_id:x}")

    def list_loras(self) -> list[LoraInfo]:
        return list(self._loras.values())


class NativeEngineBase(EngineBookkeeping, ABC):
    """The state and read-only Engine members the native adapters share; subclasses implement
    ``_generate`` and the calls that reach their engine."""

    def __init__(
        self,
        model: LocalModel,
        worker_id: int,
        info: EngineInfo,
        *,
        role: str,
        kv_event_buffer: int = DEFAULT_EVENT_BUFFER,
        data_parallel_size: int = 1,
        cleared_medium: str | None = None,
    ) -> None:
        super().__init__(worker_id, info)
        self.model = model
        self.role = role
        self._dp = data_parallel_size
        self._feed = NativeKvEventQueue(worker_id, buffer=kv_event_buffer, cleared_medium=cleared_medium)
        self._start_lock = asyncio.Lock()
        self.start_seconds = 0.0

    def _needs_start(self) -> bool:
        """False when ``start()`` has nothing to do (started already); refuses a final state."""
        if self._status in (EngineState.READY, EngineState.SLEEPING):
            return False
        if self._status in (EngineState.STOPPED, EngineState.FAILED):
            raise EngineError(f"{self.ENGINE_NAME} engine is {self._status}; create a new one")
        return True

    async def start(self) -> None:
        """STARTING while ``_start()`` builds the engine, READY after; a failed build is FAILED
        (final) and ``_release()`` frees what it had opened."""
        async with self._start_lock:
            if not self._needs_start():
                return
            self._status = EngineState.STARTING
            try:
                await self._start()
            except BaseException:
                self._status = EngineState.FAILED
                await self._release()
                raise
            self._status = EngineState.READY

    @abstractmethod
    async def _start(self) -> None:
        """Builds and starts the engine (``start`` holds the lock and the state)."""

    @abstractmethod
    async def _release(self) -> None:
        """Frees what a failed ``_start`` had opened."""

    # ---- requests ------------------------------------------------------------------------------

    def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        return self._generate(request)

    @abstractmethod
    def _generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """The engine's own stream of outputs for ``request``."""

    # ---- KV events -----------------------------------------------------------------------------

    def kv_events(self) -> AsyncIterator[RouterEvent]:
        return self._feed.events()

    async def kv_dump(self) -> list[RouterEvent]:
        return self._feed.dump()

    def _emit_cleared(self, medium: str | None = None) -> None:
        """Every rank's ``medium`` tier (None: all tiers) emptied, told to the routers at once."""
        for rank in range(self._dp):
            self._feed.emit(rank, KvCleared(medium=medium))
