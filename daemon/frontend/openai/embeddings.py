"""``POST /v1/embeddings``: text or token ids in, one vector per input out.

    body -> validated request -> embedding model -> token ids per input (context check)
         -> one ``embed`` call to a worker of the model (round-robin; another worker if it fails)
         -> ``{"object": "list", "data": [{"embedding": floats | base64}], "usage"}``

Inputs are what OpenAI accepts: a string, a list of strings, a list of token ids, or a list of
token-id lists (at most ``MAX_INPUTS``). The whole batch goes to one worker, which runs its inputs
as one batch, as a pooling engine does best. An embedding request is idempotent, so a worker that
fails (gone, draining, asleep) is simply replaced by another, up to the migration limit.

Vectors arrive as float32 bytes (``shared/protocol/embedding.py``): ``encoding_format: "base64"``
sends them base64-encoded as they are (what OpenAI sends and its client decodes, and the client's
default), ``"float"`` as JSON numbers. ``dimensions`` is checked against the model card before
routing (``resolve_dimensions``), so a model that cannot shorten its vectors answers 400 at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from dynamod.daemon.frontend.http.asgi import DisconnectWatch, Scope, header, read_body, send_error, send_json
from dynamod.daemon.frontend.http.errors import to_http_error
from dynamod.daemon.frontend.openai.schema import (
    RequestBody,
    decode_json_body,  # the chat bodies' decoding: 400 + param
    is_token_id,
)
from dynamod.daemon.frontend.pipeline.metrics import STATUS_ERROR, STATUS_SUCCESS
from dynamod.daemon.frontend.pipeline.models import EndpointPool, ServedModel
from dynamod.daemon.frontend.pipeline.request import WORKER_HEADER, FrontendRequest
from dynamod.daemon.frontend.pipeline.routing import Quarantine, RouteRequest, header_candidates
from dynamod.daemon.frontend.pipeline.serve import run_admitted
from dynamod.daemon.frontend.pipeline.state import FrontendState
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.shared.errors import (
    ContextLengthError,
    InvalidRequestError,
    NoInstancesError,
    TransportError,
    UnavailableError,
)
from dynamod.shared.protocol.embedding import VECTOR_DTYPE, EmbedRequest, EmbedResponse, resolve_dimensions
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.client import InstanceGoneError

logger = logging.getLogger(__name__)

ENDPOINT_EMBEDDINGS = "embeddings"  # the metrics' endpoint label, as Dynamo names it
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
DEFAULT_RETRIES = 3

Dimensions = Annotated[int, msgspec.Meta(ge=1, le=65536)]


class EmbeddingRequest(RequestBody, kw_only=True):
    model: str
    # msgspec allows one array type per union; the element types are checked in ``embedding_inputs``.
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Dimensions | None = None
    user: str | None = None


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


_decoder = msgspec.json.Decoder(EmbeddingRequest)
_encoder = msgspec.json.Encoder()


def decode_embedding_request(body: bytes) -> EmbeddingRequest:
    return decode_json_body(_decoder, body)  # type: ignore[no-any-return]


def embedding_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """The inputs of a request, each a string or a token-id list (``InvalidRequestError`` otherwise)."""
    if isinstance(value, str):
        inputs: list[str | list[int]] = [value]
    elif not value:
        raise InvalidRequestError("'input' must not be empty", param="input")
    elif all(is_token_id(t) for t in value):
        inputs = [list(value)]
    elif all(isinstance(t, str) for t in value):
        inputs = list(value)
    elif all(isinstance(t, list) and all(is_token_id(x) for x in t) for t in value):
        inputs = [list(t) for t in value]
    else:
        raise InvalidRequestError(
            "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            param="input",
        )
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"'input' has {len(inputs)} items; at most {MAX_INPUTS} per request", param="input")
    for i, item in enumerate(inputs):
        if not item:
            raise InvalidRequestError(f"'input' item {i} is empty; every input needs text or tokens", param="input")
    return inputs


async def tokenize_inputs(inputs: list[str | list[int]], pre: ModelPreprocessor, context_length: int) -> list[list[int]]:
    """Token ids per input, each checked against the vocabulary and the model's context."""
    out: list[list[int]] = []
    vocab = pre.vocab_size
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            ids = await pre.encode(item, add_special_tokens=True)
        else:
            bad = next((t for t in item if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {bad} in input {i} is out of the vocabulary (size {vocab})", param="input")
            ids = item
        if not ids:
            raise InvalidRequestError(f"'input' item {i} has no tokens after tokenization", param="input")
        if context_length and len(ids) > context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {context_length} tokens. However, input {i} has "
                f"{len(ids)} tokens. Please shorten the input.",
                param="input",
            )
        out.append(ids)
    return out


def embedding_body(reply: EmbedResponse, encoding: str, model: str, prompt_tokens: int) -> bytes:
    """The OpenAI response body; base64 is the float32 bytes as they came from the worker."""
    if encoding == "base64":
        data = [EmbeddingData(index=i, embedding=base64.b64encode(v).decode("ascii")) for i, v in enumerate(reply.embeddings)]
    else:
        data = [EmbeddingData(index=i, embedding=np.frombuffer(v, dtype=VECTOR_DTYPE).tolist()) for i, v in enumerate(reply.embeddings)]
    usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    return _encoder.encode(EmbeddingList(data=data, model=model, usage=usage))


class EmbeddingsEndpoint:
    """The ASGI endpoint; shares the frontend's admission (draining, ``--max-inflight``) and metrics."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        start = time.perf_counter()
        state = self.state
        request_id = uuid.uuid4().hex
        try:
            req = decode_embedding_request(await read_body(receive))
            if (refusal := state.admission_refusal()) is not None:
                raise refusal[1]
            model = state.registry.get_embedding(req.model)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            state.metrics.count_request("unknown", ENDPOINT_EMBEDDINGS, False, STATUS_ERROR)
            await send_error(send, to_http_error(exc, request_id=request_id))
            return
        request = FrontendRequest(
            request_id=request_id, scope=scope, send=send, body=req, model=model, started_at=start,
            watch=DisconnectWatch(receive),
        )
        await run_admitted(state, request, ENDPOINT_EMBEDDINGS, 1, lambda: self._serve(request))

    async def _serve(self, request: FrontendRequest[EmbeddingRequest]) -> str:
        send = request.send
        watch = request.watch
        try:
            body, worker_id, tokens = await self._embed(request.scope, request.body, request.model, request.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - nothing sent yet: a proper HTTP error
            watch.done()
            await send_error(send, to_http_error(exc, request_id=request.request_id))
            return STATUS_ERROR
        watch.done()
        await send_json(send, 200, body, [(WORKER_HEADER, worker_id_hex(worker_id).encode())])
        metrics = request.model.metrics
        metrics.isl.observe(tokens)
        metrics.prompt_tokens.inc(tokens)
        return STATUS_SUCCESS

    async def _embed(self, scope: Scope, req: EmbeddingRequest, model: ServedModel, request_id: str) -> tuple[bytes, int, int]:
        """(response body, worker id, tokens embedded)."""
        inputs = embedding_inputs(req.input)
        spec = model.card.embedding
        assert spec is not None  # the registry keeps no embedding model without one
        dimensions = resolve_dimensions(req.dimensions, spec)
        pre = await model.preprocessor()
        token_ids = await tokenize_inputs(inputs, pre, model.context_length)
        body = EmbedRequest(
            request_id=request_id, model=model.card.base_model or model.name, inputs=token_ids,
            dimensions=None if dimensions == spec.dimensions else dimensions, lora_name=model.lora_name,
        )
        direct = header(scope, WORKER_HEADER)
        direct_ids = header_candidates(direct) if direct else None
        reply, worker_id = await EmbedCall(self.state, model, body, direct_ids).run()
        if len(reply.embeddings) != len(token_ids):
            raise UnavailableError(f"worker {worker_id:x} returned {len(reply.embeddings)} vectors for {len(token_ids)} inputs")
        tokens = sum(len(ids) for ids in token_ids)
        encoding = req.encoding_format or "float"
        return embedding_body(reply, encoding, req.model, tokens), worker_id, tokens


class EmbedCall:
    """One ``embed`` request to the model's workers: pick one, and on a failure that is the
    worker's (gone, draining, asleep) try another, up to the migration limit."""

    def __init__(self, state: FrontendState, model: ServedModel, body: EmbedRequest, direct_ids: list[int] | None) -> None:
        self.state = state
        self.model = model
        self.body = body
        self.direct_ids = direct_ids
        limit = state.dispatcher.migration_limit
        self.retries = limit if limit >= 0 else model.card.migration_limit or DEFAULT_RETRIES

    async def run(self) -> tuple[EmbedResponse, int]:
        exclude: set[int] = set()
        attempt = 0
        dispatcher = self.state.dispatcher
        while True:
            instance, pool = await self._choose(exclude)
            worker_id = instance.instance_id
            try:
                frames = [f async for f in pool.client.stream_to(instance, self.body, request_id=self.body.request_id)]
            except (TransportError, UnavailableError) as exc:
                if isinstance(exc, TransportError) and not isinstance(exc, InstanceGoneError):
                    dispatcher.report_dead(worker_id)
                exclude.add(worker_id)
                attempt += 1
                if self.direct_ids is not None or attempt > self.retries:
                    raise
                logger.info(
                    "embedding retried request_id=%s from_worker=%016x attempt=%d error=%s",
                    self.body.request_id, worker_id, attempt, exc,
                )
                continue
            if not frames:
                raise TransportError(f"worker {worker_id:x} ended the embed stream without a reply")
            try:
                return msgspec.convert(frames[-1], EmbedResponse), worker_id
            except msgspec.ValidationError as exc:
                raise UnavailableError(f"worker {worker_id:x} sent a malformed embed reply: {exc}") from None

    async def _choose(self, exclude: set[int]) -> tuple[Instance, EndpointPool]:
        if self.direct_ids is not None:
            for wid in self.direct_ids:
                found = self.model.live_instance(wid)
                if found is not None:
                    return found
            shown = ", ".join(worker_id_hex(w) for w in self.direct_ids)
            raise NoInstancesError(f"no live worker {shown} serves model {self.model.name!r} (x-dynamo-worker-instance-id)")
        candidates = await self._candidates(exclude)
        router = self.model.router
        assert router is not None
        choice = await router.select(RouteRequest(self.body.request_id, []), candidates)
        return choice.instance, self.model.workers[choice.worker_id]

    async def _candidates(self, exclude: set[int]) -> list[Instance]:
        """Ready workers of the model, waiting up to ``--worker-wait`` for one to appear."""
        dispatcher = self.state.dispatcher
        registry = dispatcher.registry
        deadline = time.monotonic() + dispatcher.worker_wait_s
        while True:
            candidates = self.model.candidates(dispatcher.quarantine, exclude)
            if candidates:
                return candidates
            left = deadline - time.monotonic()
            if left <= 0:
                candidates = self.model.candidates(Quarantine(0), exclude)  # a quarantined worker beats a 503
                if candidates:
                    return candidates
                raise NoInstancesError(
                    f"no ready worker serves embedding model {self.model.name!r} (waited {dispatcher.worker_wait_s:.1f}s)"
                )
            await registry.wait_changed(left)
            current = registry.embedding_models.get(self.model.name)
            if current is not None:
                self.model = current  # all workers gone, then back: follow the name
