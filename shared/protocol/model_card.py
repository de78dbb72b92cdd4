"""The model deployment card stored under ``v1/mdc/...`` (JSON).

A frontend learns everything it needs to serve a model from this card: the name clients use, what
kind of requests it takes, where its tokenizer and chat template live, and the engine's KV geometry
for routing. A LoRA adapter is published as its own card with ``lora`` set.
"""

from __future__ import annotations

import msgspec

from dynamod.shared.protocol.model_files import ModelFilesRef

MODEL_TYPE_CHAT = "chat"
MODEL_TYPE_COMPLETIONS = "completions"
MODEL_TYPE_PREFILL = "prefill"
MODEL_TYPE_EMBEDDING = "embedding"  # serves ``embed`` (shared/protocol/embedding.py), not ``generate``
MODEL_TYPE_ENCODE = "encode"  # an encode worker: serves ``encode`` (shared/protocol/encode.py) for the model

# The output parsers a worker may name in its card (``--tool-call-parser``, ``--reasoning-parser``)
# and the frontend looks up (daemon/frontend/parsers/registry.py holds the parsers under these
# names). Here so that the worker checks its flags without importing the frontend. The names follow
# Dynamo's and vLLM's where they have one, so a deployment's flags carry over.
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSER_NAMES = ("basic", "qwen3", "deepseek_r1", "gpt_oss")


class RuntimeConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    data_parallel_size: int = 1


class EmbeddingSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What an embedding model returns: the frontend checks a request's ``dimensions`` against it
    before routing. ``matryoshka``: shorter vectors are the full one truncated and re-normalised
    (OpenAI's text-embedding-3, vLLM's Matryoshka models); only then may a client ask for fewer
    dimensions, and ``matryoshka_dimensions``, when not empty, lists the only sizes allowed."""

    dimensions: int
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = []


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    served_model_name: str
    model_types: list[str] = msgspec.field(default_factory=lambda: [MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS])
    tokenizer_source: str = ""  # the worker's model directory (informational; see model_files)
    chat_template: str | None = None  # inline template; None means take it from tokenizer_source
    context_length: int = 0
    kv_block_size: int = 0
    runtime_config: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    lora: str | None = None  # adapter name when this card describes a LoRA adapter
    base_model: str | None = None  # for LoRA cards: the served name of the base model
    eos_token_ids: list[int] = []
    migration_limit: int = 3
    # How the frontend reads this model's output (one of TOOL_CALL_PARSER_NAMES and of
    # REASONING_PARSER_NAMES). None: the text is content as it comes.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    embedding: EmbeddingSpec | None = None  # set on cards of model type ``embedding``
    # The tokenizer files themselves, published in discovery by content hash: a frontend loads the
    # tokenizer from these and never opens ``tokenizer_source`` (a path on the worker's disk). None:
    # a card from an older worker; the frontend then falls back to ``tokenizer_source``.
    model_files: ModelFilesRef | None = None


def encode_card(card: ModelCard) -> bytes:
    return msgspec.json.encode(card)


def decode_card(data: bytes) -> ModelCard:
    return msgspec.json.decode(data, type=ModelCard)
