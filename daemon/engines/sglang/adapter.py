"""The SGLang engine's entry points for the engine factory (daemon/engines/factory.py)."""

from __future__ import annotations

import argparse
import os

from dynamod.daemon.engines.common.disagg import worker_role
from dynamod.daemon.engines.common.flags import engine_tokens
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.sglang.engine import SglangEngine
from dynamod.daemon.models.local import LocalModel


def add_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--sglang-args",
        default=os.environ.get("DYN_SGLANG_ARGS", ""),
        metavar="ARGS",
        help="SGLang server flags, shell-quoted, parsed by SGLang itself, e.g. \"--tp-size 2 --enable-lora\". "
        "dynamod sets --model-path, --skip-tokenizer-init, --stream-output, --enable-cache-report and KV events, "
        "defaults --page-size to 64, and for --role prefill|decode sets --disaggregation-mode (transfer backend "
        "nixl and a free bootstrap port unless given) [env DYN_SGLANG_ARGS]",
    )


def create(args: argparse.Namespace, model: LocalModel, *, worker_id: int, worker_index: int = 0) -> SglangEngine:
    tokens = engine_tokens(getattr(args, "sglang_args", ""), getattr(args, "engine_args", None))
    return SglangEngine(tokens, model, worker_id, context_length=getattr(args, "context_length", None),
                        kv_event_buffer=getattr(args, "vllm_kv_event_buffer", DEFAULT_EVENT_BUFFER),
                        role=worker_role(args), advertise_host=getattr(args, "host", None) or "127.0.0.1")
