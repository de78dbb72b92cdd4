"""The vLLM engine's entry points for the engine factory (daemon/engines/factory.py).

``--vllm-args`` carries vLLM's own engine flags (see flags.py); vLLM itself is imported only when
the engine starts, so ``--help`` and the other engines never pay for it.
"""

from __future__ import annotations

import argparse
import os

from dynamod.daemon.engines.common.disagg import worker_role
from dynamod.daemon.engines.common.flags import engine_tokens
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.vllm.embedding import VllmEmbeddingEngine
from dynamod.daemon.engines.vllm.engine import VllmEngine
from dynamod.daemon.models.local import LocalModel


def add_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--vllm-args",
        default=os.environ.get("DYN_VLLM_ARGS", ""),
        metavar="ARGS",
        help="vLLM engine flags, shell-quoted, parsed by vLLM itself, e.g. \"--block-size 32 --enforce-eager "
        "--enable-lora --max-lora-rank 8\". dynamod sets --model, turns prefix caching and KV events on and "
        "defaults --block-size to 64 [env DYN_VLLM_ARGS]",
    )
    group.add_argument(
        "--vllm-kv-event-buffer",
        type=int,
        default=DEFAULT_EVENT_BUFFER,
        metavar="N",
        help=f"router events held for the event plane; overflow makes routers re-read kv_dump [default {DEFAULT_EVENT_BUFFER}]",
    )


def create(args: argparse.Namespace, model: LocalModel, *, worker_id: int, worker_index: int = 0) -> VllmEngine:
    """A vLLM engine for one worker; nothing heavy happens until ``start()``. The worker's
    ``--role`` decides its KV connector (vllm/disagg.py); ``--host`` is where a prefill engine's
    NIXL side channel is reached from other nodes."""
    tokens = engine_tokens(getattr(args, "vllm_args", ""), getattr(args, "engine_args", None))
    engine_class = VllmEmbeddingEngine if getattr(args, "model_type", "chat") == "embedding" else VllmEngine
    return engine_class(
        tokens,
        model,
        worker_id,
        context_length=getattr(args, "context_length", None),
        kv_event_buffer=getattr(args, "vllm_kv_event_buffer", DEFAULT_EVENT_BUFFER),
        role=worker_role(args),
        advertise_host=getattr(args, "host", None) or "127.0.0.1",
    )
