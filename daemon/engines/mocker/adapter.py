"""The mocker's entry points for the engine factory (daemon/engines/factory.py).

``add_args`` puts the mocker's flags into the group the factory gives it; ``create`` builds a
``MockerEngine`` from the parsed flags and the resolved model, whose tokenizer sets the vocabulary,
the EOS ids and the context length.
"""

from __future__ import annotations

import argparse
import logging

from dynamod.daemon.engines.mocker.config import add_mocker_flags, config_from_args
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.models.registry import LocalModel

logger = logging.getLogger(__name__)


def add_args(group: argparse._ActionsContainer) -> None:
    add_mocker_flags(group)


def create(args: argparse.Namespace, model: LocalModel, *, worker_id: int, worker_index: int = 0) -> MockerEngine:
    """A mocker engine for one worker. A model context longer than the KV cache holds is capped
    at the KV capacity (and the card says so), since a request that long could never run."""
    capacity = args.num_gpu_blocks * args.block_size
    context_length = model.context_length
    if context_length > capacity > 0:
        logger.warning(
            "mocker context capped worker_index=%d model_context_length=%d kv_capacity_tokens=%d",
            worker_index, context_length, capacity,
        )
        context_length = capacity
    config = config_from_args(
        args,
        vocab_size=model.vocab_size,
        eos_token_ids=model.eos_token_ids,
        context_length=context_length,
    )
    return MockerEngine(config, worker_id)
