"""The mocker's entry points for the engine factory (daemon/engines/factory.py).

``add_args`` puts the mocker's flags into the group the factory gives it; ``create`` builds a
``MockerEngine`` from the parsed flags and the resolved model, whose tokenizer sets the vocabulary,
the EOS ids and the context length. A prefill or decode worker's engine also keeps its KV blocks
as bytes, sized from the model's config.json (or ``--kv-bytes-per-token``), for the transfer agent.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from dynamod.daemon.engines.mocker.config import MockerConfig, add_mocker_flags, config_from_args
from dynamod.daemon.engines.mocker.embedding import MockerEmbeddingEngine, add_embedding_args
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.models.kv_layout import geometry_for_bytes_per_token
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.kv_transfer import KvLayout
from dynamod.shared.security.private_dir import ensure_private_dir, private_root_for

logger = logging.getLogger(__name__)

DISAGG_ROLES = ("prefill", "decode")


def add_args(group: argparse._ActionsContainer) -> None:
    add_mocker_flags(group)
    add_embedding_args(group)
    group.add_argument(
        "--kv-bytes-per-token", type=int, default=None,
        help="prefill/decode roles: KV bytes per token to hold and transfer, instead of the model's "
        "(layers x kv heads x head dim x 2 x dtype bytes from config.json), e.g. 131072 for an 8B "
        "Llama in bf16 [default: the model's]",
    )


def kv_layout_for(args: argparse.Namespace, model: LocalModel) -> KvLayout | None:
    """The KV block layout a mocker keeps bytes for: a prefill/decode worker's (transfers) and any
    worker's with a host or disk KV tier (offloads move real bytes, the disk tier writes them to
    files); None otherwise."""
    tiers = getattr(args, "num_host_blocks", 0) or getattr(args, "num_disk_blocks", 0)
    if getattr(args, "role", "agg") not in DISAGG_ROLES and not tiers:
        return None
    override = getattr(args, "kv_bytes_per_token", None)
    geometry = geometry_for_bytes_per_token(override) if override is not None else model.kv_geometry
    if geometry is None:
        raise ConfigError(
            f"model {model.name!r} has no KV geometry in config.json (num_hidden_layers, num_key_value_heads, "
            "head_dim or hidden_size/num_attention_heads); pass --kv-bytes-per-token for a disaggregated mocker"
        )
    return geometry.layout(args.block_size)


def disk_dir_for(config: MockerConfig, worker_index: int) -> Path:
    """One worker's part of ``--disk-cache-dir`` (each rank adds ``dp{rank}``). A persistent tier
    is found again by the worker's index (the same command restarted); a throw-away one is private
    to this process, so two daemons on one host never share files."""
    base = Path(config.disk_cache_dir)
    if config.disk_cache_persist:
        return base / f"worker-{worker_index}"
    return base / f"run-{os.getpid()}-{worker_index}"


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
    if config.num_disk_blocks:
        # KV blocks are prompt content: this user's directory alone, or refuse to start.
        ensure_private_dir(config.disk_cache_dir, what="--disk-cache-dir",
                           owned_from=private_root_for(config.disk_cache_dir))
    config.disk_cache_dir = str(disk_dir_for(config, worker_index))
    if getattr(args, "model_type", "chat") == "embedding":
        return MockerEmbeddingEngine(config, worker_id, dimensions=args.embedding_dimensions)
    return MockerEngine(config, worker_id, kv_layout=kv_layout_for(args, model), tokenizer_path=model.tokenizer_path)
