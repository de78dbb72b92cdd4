"""Node daemon: hosts one engine per worker, serves generate and control endpoints, publishes KV
events and load.

Roles: ``agg`` (prefill and decode), ``decode`` and ``prefill`` (disaggregated pools). Component
names follow Dynamo: ``backend`` for agg/decode workers and ``prefill`` for prefill workers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os

from dynamod.daemon.engines.factory import ENGINES, add_engine_args, create_engine
from dynamod.daemon.models.local import LocalModel, resolve_model
from dynamod.daemon.worker.engine import EngineInfo
from dynamod.daemon.worker.kv_transfer import add_kv_transfer_args, kv_transfer_settings
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.daemon.worker.service import WorkerService
from dynamod.shared.config import add_runtime_args, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.model_card import (
    MODEL_TYPE_CHAT,
    MODEL_TYPE_COMPLETIONS,
    MODEL_TYPE_PREFILL,
    ModelCard,
)
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

COMPONENT_BY_ROLE = {"agg": "backend", "decode": "backend", "prefill": "prefill"}
DISAGG_ROLES = ("prefill", "decode")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("worker")
    g.add_argument("--engine", choices=sorted(ENGINES), default=os.environ.get("DYN_ENGINE", "mocker"),
                   help="inference engine [env DYN_ENGINE, default mocker]")
    g.add_argument("--model", default=os.environ.get("DYN_MODEL", "tiny"),
                   help="model directory, or 'tiny' for the shipped test model [env DYN_MODEL, default tiny]")
    g.add_argument("--served-model-name", help="name clients use (default: the model's name)")
    g.add_argument("--component", help="component name (default: backend for agg/decode, prefill for prefill)")
    g.add_argument("--num-workers", type=int, default=1, help="engines in this process, each its own instance [default 1]")
    g.add_argument("--context-length", type=int, help="override the model's context length")
    g.add_argument("--migration-limit", type=int, default=3, help="times a frontend may migrate a broken stream [default 3]")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGTERM [default 30]")
    add_kv_transfer_args(parser.add_argument_group("kv transfer (roles prefill and decode)"))
    add_runtime_args(parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Adds the chosen engine's flags, then parses. A real engine gets the flags dynamod does not
    know passed through to it (``args.engine_args``), so ``--enforce-eager`` reaches vLLM as is;
    the mocker has no such pass-through and unknown flags are an error."""
    pre = argparse.ArgumentParser(add_help=False)
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


def build_card(args: argparse.Namespace, model: LocalModel, engine_info: EngineInfo) -> ModelCard:
    types = [MODEL_TYPE_PREFILL] if args.role == "prefill" else [MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS]
    return ModelCard(
        served_model_name=args.served_model_name or model.name,
        model_types=types,
        tokenizer_source=str(model.tokenizer_path),
        chat_template=model.chat_template,
        context_length=engine_info.context_length,
        kv_block_size=engine_info.kv_block_size,
        runtime_config=engine_info.runtime_config,
        eos_token_ids=list(engine_info.eos_token_ids),
        migration_limit=args.migration_limit,
    )


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    if args.num_workers < 1:
        raise ConfigError("--num-workers must be at least 1")
    settings = settings_from_args(args)
    model = resolve_model(args.model)
    if args.context_length:
        model = dataclasses.replace(model, context_length=args.context_length)
    runtime = await DistributedRuntime.create(settings)
    services: list[WorkerService] = []
    try:
        component = runtime.namespace().component(args.component or COMPONENT_BY_ROLE[args.role])
        metrics = WorkerMetrics(runtime.registry)
        for index in range(args.num_workers):
            lease = runtime.lease if index == 0 else await runtime.create_lease()
            assert lease is not None
            engine = create_engine(args.engine, args, model, worker_id=lease.id, worker_index=index)
            service = WorkerService(
                component,
                engine,
                lambda info: build_card(args, model, info),
                lease,
                role=args.role,
                metrics=metrics,
                kv_transfer=kv_transfer_settings(args, settings.host, index) if args.role in DISAGG_ROLES else None,
            )
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
        await runtime.shutdown(grace_s=args.shutdown_grace)
    return 0
