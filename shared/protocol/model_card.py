"""The model deployment card stored under ``v1/mdc/...`` (JSON).

A frontend learns everything it needs to serve a model from this card: the name clients use, what
kind of requests it takes, where its tokenizer and chat template live, and the engine's KV geometry
for routing. A LoRA adapter is published as its own card with ``lora`` set.
"""

from __future__ import annotations

import msgspec

MODEL_TYPE_CHAT = "chat"
MODEL_TYPE_COMPLETIONS = "completions"
MODEL_TYPE_PREFILL = "prefill"


class RuntimeConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    data_parallel_size: int = 1


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    served_model_name: str
    model_types: list[str] = msgspec.field(default_factory=lambda: [MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS])
    tokenizer_source: str = ""  # a directory with tokenizer.json (+ tokenizer_config.json)
    chat_template: str | None = None  # inline template; None means take it from tokenizer_source
    context_length: int = 0
    kv_block_size: int = 0
    runtime_config: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    lora: str | None = None  # adapter name when this card describes a LoRA adapter
    base_model: str | None = None  # for LoRA cards: the served name of the base model
    eos_token_ids: list[int] = []
    migration_limit: int = 3


def encode_card(card: ModelCard) -> bytes:
    return msgspec.json.encode(card)


def decode_card(data: bytes) -> ModelCard:
    return msgspec.json.decode(data, type=ModelCard)
