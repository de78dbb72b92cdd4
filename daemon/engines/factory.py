"""Builds the engine chosen by ``--engine``, importing its package only then.

A node without vLLM, SGLang or TensorRT-LLM installed runs the mocker; asking for a missing engine
gives one clear line naming the package to install.
"""

from __future__ import annotations

import argparse
import importlib

from dynamod.daemon.engines.base import Engine
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.errors import ConfigError

ENGINES: dict[str, str] = {
    "mocker": "dynamod.daemon.engines.mocker.adapter",
    "vllm": "dynamod.daemon.engines.vllm.adapter",
    "sglang": "dynamod.daemon.engines.sglang.adapter",
    "trtllm": "dynamod.daemon.engines.trtllm.adapter",
}


def add_engine_args(parser: argparse.ArgumentParser, engine: str) -> None:
    """The chosen engine's own flags (``--help`` shows them for the ``--engine`` given). Only one
    engine's group is added: engines share flag names (``--block-size``) with different meanings."""
    module_name = ENGINES.get(engine)
    if module_name is None:
        return
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    module.add_args(parser.add_argument_group(f"{engine} engine"))


def create_engine(name: str, args: argparse.Namespace, model: LocalModel, worker_id: int, worker_index: int) -> Engine:
    module_name = ENGINES.get(name)
    if module_name is None:
        raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"engine {name!r} is not available here: {exc}") from exc
    return module.create(args, model, worker_id=worker_id, worker_index=worker_index)
