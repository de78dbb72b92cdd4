"""The vLLM engine's entry points for the engine factory (daemon/engines/factory.py).

``--vllm-args`` carries vLLM's own engine flags (see flags.py); vLLM itself is imported only when
the engine starts, so ``--help`` and the other engines never pay for it. ``--num-host-blocks`` is
the mocker's flag with the same meaning, here turning on vLLM's own host KV tier (offload.py).
"""

from __future__ import annotations

import argparse
import os

from dynamod.daemon.engines.common.disagg import worker_role
from dynamod.daemon.engines.common.flags import engine_tokens
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.vllm import flags, offload
from dynamod.daemon.engines.vllm.embedding import VllmEmbeddingEngine
from dynamod.daemon.engines.vllm.engine import VllmEngine
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.config import settings_from_args
from dynamod.shared.errors import ConfigError


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
    group.add_argument(
        "--num-host-blocks",
        type=int,
        default=os.environ.get("DYN_NUM_HOST_BLOCKS", "0"),  # argparse converts a string default
        metavar="N",
        help="host (CPU) KV tier per data-parallel rank, in blocks: vLLM's OffloadingConnector copies device "
        "blocks to host memory and loads a prefix found there instead of recomputing it; the router indexes "
        "that tier and credits it. Sized from the model's KV geometry (vLLM's own --kv-offloading-size GiB in "
        "--vllm-args works too); CUDA/ROCm/XPU builds of vLLM only; 0 disables it "
        "[env DYN_NUM_HOST_BLOCKS, default %(default)s]",
    )


def advertised_host(args: argparse.Namespace) -> str:
    """Where other nodes reach this worker's engine side channels (NIXL): the daemon's
    ``--advertise-host`` rule (shared/config.py), so a NATed or wildcard-bound worker hands out an
    address its peers can dial."""
    settings = settings_from_args(args)
    return settings.advertised(settings.host)


def create(args: argparse.Namespace, model: LocalModel, *, worker_id: int, worker_index: int = 0) -> VllmEngine:
    """A vLLM engine for one worker; nothing heavy happens until ``start()``. The worker's
    ``--role`` decides its KV connector (vllm/disagg.py), ``--num-host-blocks`` its host tier
    (vllm/offload.py); the advertised host is where a prefill engine's NIXL side channel is
    reached from other nodes."""
    tokens = engine_tokens(getattr(args, "vllm_args", ""), getattr(args, "engine_args", None))
    host_bytes = offload.host_tier_request(
        tokens, getattr(args, "num_host_blocks", 0) or 0, flags.estimates(tokens).block_size, model.kv_geometry
    )
    engine_class = VllmEmbeddingEngine if getattr(args, "model_type", "chat") == "embedding" else VllmEngine
    if engine_class is VllmEmbeddingEngine and host_bytes is not None:
        raise ConfigError("an embedding worker keeps no KV cache to offload; drop --num-host-blocks")
    return engine_class(
        tokens,
        model,
        worker_id,
        context_length=getattr(args, "context_length", None),
        kv_event_buffer=getattr(args, "vllm_kv_event_buffer", DEFAULT_EVENT_BUFFER),
        role=worker_role(args),
        advertise_host=advertised_host(args),
        host_tier_bytes=host_bytes,
    )
