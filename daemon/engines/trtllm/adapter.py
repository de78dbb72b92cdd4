"""The TensorRT-LLM engine's entry points for the engine factory (daemon/engines/factory.py)."""

from __future__ import annotations

import argparse
import os

from dynamod.daemon.engines.common.disagg import worker_role
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.trtllm.engine import TrtllmEngine, llm_kwargs
from dynamod.daemon.models.local import LocalModel


def add_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--trtllm-args",
        default=os.environ.get("DYN_TRTLLM_ARGS", ""),
        metavar="JSON",
        help="TensorRT-LLM LLM() keyword arguments as a JSON object, or @FILE (.json/.yaml), e.g. "
        "'{\"tensor_parallel_size\": 2}'. dynamod sets model, block reuse and the KV event buffer, and defaults "
        "kv_cache_config.tokens_per_block to 64; for --role prefill|decode it defaults cache_transceiver_config to "
        "{\"backend\": \"DEFAULT\"} (and disable_overlap_scheduler on prefill) [env DYN_TRTLLM_ARGS]",
    )


def create(args: argparse.Namespace, model: LocalModel, *, worker_id: int, worker_index: int = 0) -> TrtllmEngine:
    role = worker_role(args)
    options = llm_kwargs(getattr(args, "trtllm_args", ""), model_path=str(model.path),
                         context_length=getattr(args, "context_length", None), role=role)
    return TrtllmEngine(options, model, worker_id, role=role,
                        kv_event_buffer=getattr(args, "vllm_kv_event_buffer", DEFAULT_EVENT_BUFFER))
