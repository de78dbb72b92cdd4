"""The mocker engine: behaves like vLLM (paged KV cache with prefix caching, vLLM v1 scheduling,
KV events) with Dynamo's timing model instead of a GPU.

Layers, each calling only the one below: ``engine.MockerEngine`` (async Engine Protocol, one step
loop per data-parallel rank) -> ``core.MockerCore`` (synchronous, clock-free; what trace replay
drives) -> ``scheduler.Scheduler`` -> ``kv_manager.KVCacheManager`` -> ``block_pool.BlockPool``.
"""

from dynamod.daemon.engines.mocker.config import (
    MockerConfig,
    MockerConfigError,
    add_mocker_args,
    config_from_args,
)
from dynamod.daemon.engines.mocker.core import CoreLoad, FinishedRequest, MockerCore, StepOutput
from dynamod.daemon.engines.mocker.engine import LoopStats, MockerEngine

__all__ = [
    "CoreLoad",
    "FinishedRequest",
    "LoopStats",
    "MockerConfig",
    "MockerConfigError",
    "MockerCore",
    "MockerEngine",
    "StepOutput",
    "add_mocker_args",
    "config_from_args",
]
