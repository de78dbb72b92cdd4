"""The SGLang engine's entry points for the engine factory (daemon/engines/factory.py)."""

from __future__ import annotations

import argparse
import os

from dynamod.daemon.engines.common.disagg import worker_role
from dynamod.daemon.engines.common.flags import engine_tokens
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.sglang.engine import SglangEngine
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.config import settings_from_args


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


def advertised_host(args: argparse.Namespace) -> str:
    """Where decode workers on other hosts reach this engine's bootstrap server: exactly what the
    runtime advertises for ``--host`` (``--advertise-host`` / ``DYN_ADVERTISE_HOST`` when given, the
    node's primary address for a wildcard, ``DYN_HOST`` when the flag is absent), so SGLang's
    bootstrap address agrees with the request plane's and the KV transfer's."""
    settings = settings_from_args(args)
    return settings.advertised(settings.host)


def create(args: argparse.Namespace, model: LocalModel, *, worker_id: int, worker_index: int = 0) -> SglangEngine:
    tokens = engine_tokens(getattr(args, "sglang_args", ""), getattr(args, "engine_args", None))
    return SglangEngine(tokens, model, worker_id, context_length=getattr(args, "context_length", None),
                        kv_event_buffer=getattr(args, "vllm_kv_event_buffer", DEFAULT_EVENT_BUFFER),
                        role=worker_role(args), advertise_host=advertised_host(args))
