"""Node daemon: hosts one engine per worker, serves generate and control endpoints, publishes KV
events and load.

Roles: ``agg`` (prefill and decode), ``decode`` and ``prefill`` (disaggregated pools). Component
names follow Dynamo: ``backend`` for agg/decode workers and ``prefill`` for prefill workers.

Each engine has a *worker name* that stays the same across restarts (its instance id does not):
the operator's intent (drain, sleep, LoRA adapters) is kept in discovery under that name and
re-applied when the worker starts again (``worker_names``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Collection

from dynamod.daemon.encode.metrics import EmbeddingCacheMetrics
from dynamod.daemon.encode.model import vision_hidden_size
from dynamod.daemon.encode.receiver import (
    DEFAULT_EMBEDDING_CACHE_MB,
    EmbeddingReceiver,
    start_receiver,
)
from dynamod.daemon.engines.base import EngineInfo
from dynamod.daemon.engines.factory import ENGINES, add_engine_args, create_engine
from dynamod.daemon.models.local import LocalModel, resolve_model
from dynamod.daemon.worker.kv_transfer import add_kv_transfer_args, kv_transfer_settings
from dynamod.daemon.worker.lora_policy import add_lora_args, lora_policy_from_args
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.daemon.worker.service import WorkerService
from dynamod.shared.config import add_runtime_args, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.model_card import (
    MODEL_TYPE_CHAT,
    MODEL_TYPE_COMPLETIONS,
    MODEL_TYPE_EMBEDDING,
    MODEL_TYPE_PREFILL,
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    ModelCard,
)
from dynamod.shared.protocol.model_files import ModelFilesRef
from dynamod.shared.protocol.planner import POOL_COMPONENT, ROLE_POOL
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.intent import IntentRecorder
from dynamod.shared.runtime.model_files import ModelFiles, ModelFilesPublisher
from dynamod.shared.transport.address import is_loopback_host

logger = logging.getLogger(__name__)

# The component each role registers under (Dynamo's names: decode and agg share ``backend``).
COMPONENT_BY_ROLE = {role: POOL_COMPONENT[pool] for role, pool in ROLE_POOL.items()}
DISAGG_ROLES = ("prefill", "decode")
EMBEDDING_ROLES = ("agg", "prefill", "decode")  # the roles that may prefill images (decode: when local)
MODEL_TYPE_CHOICES = ("chat", MODEL_TYPE_EMBEDDING)  # chat: chat and text completions (``generate``)
EMBEDDING_ENGINES = ("mocker", "vllm")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("worker")
    g.add_argument("--engine", choices=sorted(ENGINES), default=os.environ.get("DYN_ENGINE", "mocker"),
                   help="inference engine [env DYN_ENGINE, default mocker]")
    g.add_argument("--model", default=os.environ.get("DYN_MODEL", "tiny"),
                   help="model directory, or 'tiny' / 'tiny-vl' (vision-language) for the shipped test models "
                        "[env DYN_MODEL, default tiny]")
    g.add_argument("--served-model-name", help="name clients use (default: the model's name)")
    g.add_argument("--model-type", choices=MODEL_TYPE_CHOICES, default=os.environ.get("DYN_MODEL_TYPE", "chat"),
                   help="what the model serves: chat (chat and text completions, endpoint generate) or embedding "
                        "(/v1/embeddings, endpoint embed; role agg, engines mocker and vllm) "
                        "[env DYN_MODEL_TYPE, default chat]")
    g.add_argument("--component", help="component name (default: backend for agg/decode, prefill for prefill)")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSER_NAMES), type=_parser_name(TOOL_CALL_PARSER_NAMES),
                   default=os.environ.get("DYN_TOOL_CALL_PARSER") or None,
                   help="how the frontend finds tool calls in this model's output, published in the model card "
                        "(hermes: Qwen 2.5/3 and Hermes; llama3_json: Llama 3.1+; mistral; pythonic: Llama 3.2/4) "
                        "[env DYN_TOOL_CALL_PARSER, default none: no tool calls are parsed]")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSER_NAMES), type=_parser_name(REASONING_PARSER_NAMES),
                   default=os.environ.get("DYN_REASONING_PARSER") or None,
                   help="how the frontend separates this model's reasoning into reasoning_content, published in "
                        "the model card (basic/qwen3: <think>...</think> when the reply opens with it; deepseek_r1: "
                        "the reply starts in reasoning; gpt_oss: harmony analysis channel) "
                        "[env DYN_REASONING_PARSER, default none]")
    g.add_argument("--num-workers", type=int, default=1, help="engines in this process, each its own instance [default 1]")
    g.add_argument("--context-length", type=int, help="override the model's context length")
    g.add_argument("--migration-limit", type=int, default=3, help="times a frontend may migrate a broken stream [default 3]")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGTERM [default 30]")
    g.add_argument("--worker-name", default=os.environ.get("DYN_WORKER_NAME") or None,
                   help="stable name of this worker across restarts: drain, sleep and loaded LoRA adapters are "
                        "kept in discovery under it and re-applied on start; with --num-workers N the engines are "
                        "NAME-0..NAME-(N-1) [env DYN_WORKER_NAME; default NODE-PORT from the host name and a fixed "
                        "--system-port, else none and nothing is kept across restarts]")
    g.add_argument("--embedding-cache-mb", type=float, default=DEFAULT_EMBEDDING_CACHE_MB,
                   help="vision-language models, roles agg and prefill: memory for image embeddings read from "
                        "encode workers, kept by image content hash (0: read none, encode every image here) "
                        "[default %(default)s]")
    add_lora_args(parser.add_argument_group("LoRA adapters (every engine, the mocker included)"))
    add_kv_transfer_args(parser.add_argument_group("kv transfer (roles prefill and decode)"))
    add_runtime_args(parser)


def _parser_name(known: Collection[str]) -> Callable[[str], str]:
    """argparse checks ``choices`` on the command line only; this checks a DYN_* default too."""

    def check(value: str) -> str:
        if value not in known:
            raise argparse.ArgumentTypeError(f"unknown parser {value!r}; choose one of {', '.join(sorted(known))}")
        return value

    return check


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Adds the chosen engine's flags, then parses. A real engine gets the flags dynamod does not
    know passed through to it (``args.engine_args``), so ``--enforce-eager`` reaches vLLM as is;
    the mocker has no such pass-through and unknown flags are an error."""
    pre = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    pre.add_argument("--engine", default=os.environ.get("DYN_ENGINE", "mocker"))
    engine = pre.parse_known_args(argv)[0].engine
    add_engine_args(parser, engine if engine in ENGINES else "mocker")
    if engine == "mocker":
        args = parser.parse_args(argv)
        args.engine_args = []
        return args
    args, extra = parser.parse_known_args(argv)
    args.engine_args = extra
    return args


def build_card(
    args: argparse.Namespace, model: LocalModel, engine_info: EngineInfo, model_files: ModelFilesRef | None = None
) -> ModelCard:
    if getattr(args, "model_type", "chat") == MODEL_TYPE_EMBEDDING:
        types = [MODEL_TYPE_EMBEDDING]
    elif args.role == "prefill":
        types = [MODEL_TYPE_PREFILL]
    else:
        types = [MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS]
    return ModelCard(
        served_model_name=args.served_model_name or model.name,
        model_types=types,
        tokenizer_source=str(model.tokenizer_path),
        model_files=model_files,  # the tokenizer files themselves, in discovery (frontends on other hosts)
        chat_template=model.chat_template,
        context_length=engine_info.context_length,
        kv_block_size=engine_info.kv_block_size,
        runtime_config=engine_info.runtime_config,
        eos_token_ids=list(engine_info.eos_token_ids),
        migration_limit=args.migration_limit,
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        embedding=engine_info.embedding if MODEL_TYPE_EMBEDDING in types else None,
    )


def check_model_type(args: argparse.Namespace) -> None:
    """An embedding model is served whole by one worker: no prefill/decode split, and only by an
    engine with an embedding mode."""
    model_type = getattr(args, "model_type", "chat")
    if model_type not in MODEL_TYPE_CHOICES:  # argparse checks the flag, not the DYN_MODEL_TYPE default
        raise ConfigError(f"--model-type must be one of {', '.join(MODEL_TYPE_CHOICES)}, got {model_type!r}")
    if model_type != MODEL_TYPE_EMBEDDING:
        return
    if args.role != "agg":
        raise ConfigError(f"--model-type embedding needs --role agg (an embedding has no prefill/decode split), got {args.role}")
    if args.engine not in EMBEDDING_ENGINES:
        raise ConfigError(
            f"--model-type embedding is not available with --engine {args.engine}; use one of {', '.join(EMBEDDING_ENGINES)}"
        )


def worker_names(worker_name: str | None, node_name: str, system_port: int | None, num_workers: int) -> list[str | None]:
    """One stable name per engine, or None each when there is none to be had: without
    ``--worker-name`` the name is ``NODE-PORT`` from a fixed ``--system-port`` (one status server
    per process on a host, so unique there); an ephemeral or absent port names nothing stable."""
    base = worker_name
    if base is None and system_port:
        base = f"{node_name}-{system_port}"
    if base is not None and (not base or "/" in base):
        raise ConfigError(f"--worker-name must be a non-empty name without '/', got {base!r}")
    if base is None:
        return [None] * num_workers
    return [base] if num_workers == 1 else [f"{base}-{i}" for i in range(num_workers)]


def warn_if_open(host: str, secured: bool) -> bool:
    """Warns, as the frontend does for its HTTP port, when this worker's request plane (generate,
    drain, load_lora, ...) listens beyond loopback with neither a cluster token nor TLS: anyone who
    can reach the port can drive it. True when it warned."""
    if secured or is_loopback_host(host):
        return False
    logger.warning(
        "worker request plane open beyond loopback host=%s security=none "
        "hint=set --cluster-token-file (DYN_CLUSTER_TOKEN) and/or --tls-ca-file/--tls-cert-file/--tls-key-file",
        host,
    )
    return True


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    if args.num_workers < 1:
        raise ConfigError("--num-workers must be at least 1")
    check_model_type(args)
    settings = settings_from_args(args)
    lora_policy = lora_policy_from_args(args)
    warn_if_open(settings.host, settings.security.request_plane.enabled)
    logger.info("lora policy %s", lora_policy.describe)
    names = worker_names(args.worker_name, settings.node_name, settings.system_port, args.num_workers)
    model = resolve_model(args.model)
    if args.context_length:
        model = dataclasses.replace(model, context_length=args.context_length)
    files = await asyncio.to_thread(ModelFiles.from_dir, model.path)
    runtime = await DistributedRuntime.create(settings)
    services: list[WorkerService] = []
    publishers: list[ModelFilesPublisher] = []
    receivers: list[EmbeddingReceiver] = []
    hidden = vision_hidden_size(model.path) if args.role in EMBEDDING_ROLES and args.embedding_cache_mb > 0 else None
    try:
        component = runtime.namespace().component(args.component or COMPONENT_BY_ROLE[args.role])
        metrics = WorkerMetrics(runtime.registry)
        cache_metrics: EmbeddingCacheMetrics | None = None
        if names[0] is None:
            logger.warning(
                "intent not persisted worker_name=none reason=%s",
                "no --worker-name and no fixed --system-port: drain, sleep and LoRA adapters do not survive a restart",
            )
        for index in range(args.num_workers):
            lease = runtime.lease if index == 0 else await runtime.create_lease()
            assert lease is not None
            engine = create_engine(args.engine, args, model, worker_id=lease.id, worker_index=index)
            name = names[index]
            intent = IntentRecorder(runtime.store, component.namespace.name, component.name, name) if name else None
            # The tokenizer files go into discovery before the card that names them.
            publisher = ModelFilesPublisher(runtime.store, lease, component.namespace.name, files, node=settings.node_name)
            await publisher.start()
            publishers.append(publisher)
            service = WorkerService(
                component,
                engine,
                lambda info: build_card(args, model, info, files.ref),
                lease,
                role=args.role,
                metrics=metrics,
                kv_transfer=kv_transfer_settings(
                    args, settings.host, index,
                    advertise_host=settings.advertised(settings.host), security=settings.security.request_plane,
                ) if args.role in DISAGG_ROLES else None,
                intent=intent,
                lora_policy=lora_policy,
            )
            if hidden is not None:  # a VL model: embeddings from the encode pool are read, not recomputed
                if cache_metrics is None:
                    cache_metrics = EmbeddingCacheMetrics(runtime.registry)
                service.embeddings = await start_receiver(
                    worker_id=lease.id, hidden_size=hidden, cache_mb=args.embedding_cache_mb,
                    backend=args.kv_transfer_backend, host=settings.host,
                    advertise_host=settings.advertised(settings.host), security=settings.security.request_plane,
                    request_plane_metrics=runtime.request_plane_metrics, metrics=cache_metrics,
                )
                receivers.append(service.embeddings)
            await service.start()
            services.append(service)
        logger.info(
            "node daemon up role=%s engine=%s model=%s workers=%d status_url=%s",
            args.role, args.engine, args.model, len(services), runtime.status_url or "off",
        )
        await stop.wait()
    finally:
        # Deregister everything first so routers stop sending, then let requests finish.
        await asyncio.gather(*(s.stop(args.shutdown_grace) for s in services), return_exceptions=True)
        await asyncio.gather(*(p.close() for p in publishers), return_exceptions=True)
        await asyncio.gather(*(r.close() for r in receivers), return_exceptions=True)
        await runtime.shutdown(grace_s=args.shutdown_grace)
    return 0
