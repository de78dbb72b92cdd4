"""Encode worker: runs a vision-language model's vision encoder for the frontends
(``dynamod --role encode --model tiny-vl``), component ``encoder``, endpoint ``encode``.

The encoder is the mocker's (``--encode-ms-per-image-token`` per image token, batched under
``--encode-batch-tokens``); its embeddings wait in ``--embedding-memory-mb`` of pages that the
prefill/agg workers read over the KV transfer layer (NIXL or TCP: ``--kv-transfer-backend``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from dynamod.daemon.encode.encoder import DEFAULT_BATCH_TOKENS, DEFAULT_HOLD_TIMEOUT_S, MockVisionEncoder
from dynamod.daemon.encode.metrics import EncoderMetrics
from dynamod.daemon.encode.model import model_hidden_size
from dynamod.daemon.encode.pages import EmbeddingPages, page_bytes
from dynamod.daemon.encode.service import EncodeService
from dynamod.daemon.engines.mocker.encoder import DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN
from dynamod.daemon.models.local import resolve_model
from dynamod.shared.config import add_runtime_args, settings_from_args
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.transfer.factory import create_agent
from dynamod.shared.protocol.encode import ENCODER_COMPONENT
from dynamod.shared.protocol.model_card import MODEL_TYPE_ENCODE, ModelCard
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_MEMORY_MB = 64.0


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("encode worker")
    g.add_argument("--model", default=os.environ.get("DYN_MODEL", "tiny-vl"),
                   help="vision-language model directory, or 'tiny-vl' [env DYN_MODEL, default tiny-vl]")
    g.add_argument("--served-model-name", help="the model name the frontends serve it under (default: the model's name)")
    g.add_argument("--encode-ms-per-image-token", type=float, default=DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN,
                   help="simulated encoder time per image token, ms [default %(default)s]")
    g.add_argument("--speedup-ratio", type=float, default=1.0,
                   help="encoder times are divided by this, as the mocker workers' step times [default 1]")
    g.add_argument("--encode-batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                   help="image tokens one encoder batch takes at most (one image always fits) [default %(default)s]")
    g.add_argument("--embedding-memory-mb", type=float, default=DEFAULT_EMBEDDING_MEMORY_MB,
                   help="memory for embeddings waiting to be read [default %(default)s]")
    g.add_argument("--embedding-hold-timeout", type=float, default=DEFAULT_HOLD_TIMEOUT_S,
                   help="seconds an embedding waits to be read before it is freed [default %(default)s]")
    g.add_argument("--kv-transfer-backend", choices=("auto", "nixl", "tcp"),
                   default=os.environ.get("DYN_KV_TRANSFER_BACKEND", "auto"),
                   help="how embeddings are read: nixl, tcp, or auto [env DYN_KV_TRANSFER_BACKEND, default auto]")
    g.add_argument("--kv-transfer-port", type=int, default=0,
                   help="TCP port of the embedding block server (0: any free port) [default 0]")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds to let in-flight encodes finish and held embeddings be read on SIGTERM [default 30]")
    add_runtime_args(parser)


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    if args.encode_ms_per_image_token < 0:
        raise ConfigError(f"--encode-ms-per-image-token must be >= 0, got {args.encode_ms_per_image_token}")
    if args.speedup_ratio <= 0:
        raise ConfigError(f"--speedup-ratio must be > 0, got {args.speedup_ratio}")
    if args.embedding_memory_mb <= 0:
        raise ConfigError(f"--embedding-memory-mb must be > 0, got {args.embedding_memory_mb}")
    model = resolve_model(args.model)
    hidden = model_hidden_size(model.path)
    settings = settings_from_args(args)
    block_bytes = page_bytes(hidden)
    num_pages = max(1, int(args.embedding_memory_mb * 1024 * 1024) // block_bytes)
    runtime = await DistributedRuntime.create(settings)
    service: EncodeService | None = None
    try:
        lease = runtime.lease
        assert lease is not None
        pages = EmbeddingPages(num_pages, block_bytes)
        agent = create_agent(
            pages.memory, worker_id=lease.id, backend=args.kv_transfer_backend, host=settings.host,
            port=args.kv_transfer_port, advertise_host=settings.advertised(settings.host),
            security=settings.security.request_plane, metrics=runtime.request_plane_metrics,
        )
        encoder = MockVisionEncoder(
            pages, worker_id=lease.id, hidden_size=hidden, ms_per_image_token=args.encode_ms_per_image_token / args.speedup_ratio,
            batch_tokens=args.encode_batch_tokens, hold_timeout_s=args.embedding_hold_timeout, metadata=agent.metadata,
        )
        card = ModelCard(
            served_model_name=args.served_model_name or model.name, model_types=[MODEL_TYPE_ENCODE],
            tokenizer_source=str(model.tokenizer_path), context_length=model.context_length,
        )
        component = runtime.namespace().component(ENCODER_COMPONENT)
        service = EncodeService(component, lease, card, encoder, agent, EncoderMetrics(runtime.registry))
        await service.start()
        logger.info("node daemon up role=encode model=%s status_url=%s", card.served_model_name, runtime.status_url or "off")
        await stop.wait()
    finally:
        if service is not None:
            await service.stop(args.shutdown_grace)
        await runtime.shutdown(grace_s=args.shutdown_grace)
    return 0
