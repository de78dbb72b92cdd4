"""vLLM pooling models as embedding workers (``--model-type embedding --engine vllm``).

vLLM serves an embedding model with its pooling runner: ``--runner pooling`` (added here unless the
operator chose a runner), and a decoder-only checkpoint such as a Llama is turned into an embedder
by ``--convert embed`` (vLLM picks it by itself for a generative architecture under the pooling
runner; an operator may name it in ``--vllm-args``). Each input is one ``AsyncLLM.encode`` request
with ``PoolingParams(task="embed", dimensions=...)``; vLLM pools (last token for a converted
decoder), normalises, and truncates Matryoshka models to ``dimensions`` itself.

Everything else (start, KV events, load, LoRA, stop) is ``VllmEngine``'s: this subclass only adds
the runner flag, the vector size in the card (``EmbeddingSpec`` from vLLM's model config, known
once the engine started) and ``embed``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dynamod.daemon.engines.common.engine_base import request_errors
from dynamod.daemon.engines.common.flags import has_flag
from dynamod.daemon.engines.vllm.engine import VllmEngine, request_error
from dynamod.daemon.engines.vllm.outputs import OutputTracker
from dynamod.shared.errors import EngineError, InvalidRequestError, UnavailableError
from dynamod.shared.protocol.embedding import VECTOR_DTYPE, EmbedRequest, EmbedResponse, resolve_dimensions
from dynamod.shared.protocol.model_card import EmbeddingSpec

RUNNER_FLAG = "--runner"


def pooling_tokens(tokens: list[str]) -> list[str]:
    """The operator's vLLM flags with the pooling runner unless a runner was chosen."""
    return list(tokens) if has_flag(tokens, RUNNER_FLAG) else [*tokens, RUNNER_FLAG, "pooling"]


def embedding_spec(model_config: Any) -> EmbeddingSpec:
    """What the card says about the vectors, from vLLM's ``ModelConfig``."""
    dims = list(model_config.matryoshka_dimensions or [])
    return EmbeddingSpec(
        dimensions=int(model_config.embedding_size),
        matryoshka=bool(model_config.is_matryoshka),
        matryoshka_dimensions=[int(d) for d in dims],
    )


def vector_bytes(data: Any) -> bytes:
    """A pooled tensor (any dtype, any device) as float32 little-endian bytes."""
    import numpy as np

    array = data.detach().to("cpu").float().numpy()
    if array.ndim != 1:
        raise EngineError(f"vLLM returned a pooled output of shape {tuple(array.shape)}, not one vector")
    return np.ascontiguousarray(array, dtype=VECTOR_DTYPE).tobytes()


class VllmEmbeddingEngine(VllmEngine):
    """A ``VllmEngine`` whose model runs under vLLM's pooling runner and serves ``embed``."""

    def __init__(self, tokens: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(pooling_tokens(tokens), *args, **kwargs)

    async def start(self) -> None:
        await super().start()
        config = self._llm.model_config
        if getattr(config, "runner_type", "pooling") != "pooling":
            raise EngineError(f"vLLM runs this model with the {config.runner_type!r} runner; embeddings need --runner pooling")
        self._info.embedding = embedding_spec(config)

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        self._check_serving()
        spec = self._info.embedding
        assert spec is not None, "embed before start"
        dims = resolve_dimensions(request.dimensions, spec)
        if not request.inputs:
            raise InvalidRequestError("nothing to embed: 'input' is empty", param="input")
        lora_request = None
        if request.lora_name:
            lora = self._request_lora(request.lora_name)
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(lora.name, lora.lora_id, lora.source)
        tasks: list[asyncio.Task[bytes]] = []
        # A TaskGroup: one failed or cancelled input ends the others (their requests abort in vLLM).
        async with asyncio.TaskGroup() as group:
            for i, ids in enumerate(request.inputs):
                rid = f"{request.request_id}#{i}"
                tasks.append(group.create_task(self._embed_one(rid, ids, request.dimensions, lora_request)))
        return EmbedResponse(
            embeddings=[t.result() for t in tasks], dimensions=dims, prompt_tokens=sum(len(ids) for ids in request.inputs)
        )

    async def _embed_one(self, rid: str, token_ids: list[int], dimensions: int | None, lora_request: Any) -> bytes:
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        self._check_new_request(rid)
        try:
            params = PoolingParams(task="embed", dimensions=dimensions)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"bad pooling parameters: {exc}") from None
        self._active[rid] = OutputTracker(len(token_ids))  # counted in flight for drain and stop
        final = None
        stream = self._llm.encode(TokensPrompt(prompt_token_ids=list(token_ids)), params, rid, lora_request=lora_request)
        try:
            with request_errors(request_error):
                async for out in stream:
                    final = out
        finally:
            self._active.pop(rid, None)
            if final is None or not final.finished:
                await stream.aclose()  # closing vLLM's unfinished stream aborts the request
        if final is None or not final.finished:
            raise UnavailableError(f"vLLM ended embedding request {rid!r} without a result (aborted)")
        if getattr(final, "error", None) is not None:
            raise EngineError(f"vLLM failed embedding request {rid!r}: {final.error}")
        return vector_bytes(final.outputs.data)
