"""What the worker service's unit tests share: the model card a test worker publishes."""

from __future__ import annotations

from dynamod.daemon.engines.base import EngineInfo
from dynamod.shared.protocol.model_card import ModelCard


def card_for(info: EngineInfo) -> ModelCard:
    """The card of model ``m`` with the engine's own context length, block size and runtime config
    (the worker service builds its card from what the engine reports, as in production)."""
    return ModelCard(served_model_name="m", model_types=["chat"], tokenizer_source="t", context_length=info.context_length,
                     kv_block_size=info.kv_block_size, runtime_config=info.runtime_config)
