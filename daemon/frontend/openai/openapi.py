"""``GET /openapi.json``: an OpenAPI 3.1 document of the routes this frontend serves.

The request bodies are generated from the msgspec structs the endpoints decode with
(``msgspec.json.schema_components``), so the document cannot drift from what is accepted: a field
added to a struct is in the schema, a bound on it is the same bound. The ``model`` of each request
is an ``enum`` of the models served at the time of the request (built from the registry, as
``/v1/models`` is): another name is a 404, so the enum is the truth about what is accepted. The
fields msgspec sees as ``Any`` (chat messages, prompts, Responses input, tools) are spelled out by
``openapi_fields`` as the frontend's own checks accept them.

Used by clients that generate code from a schema and by the schema fuzz test
(``tests/integration/frontend/test_frontend_schemathesis.py``).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import msgspec

from dynamod.daemon.frontend.http.asgi import Scope, send_json
from dynamod.daemon.frontend.http.errors import ErrorBody
from dynamod.daemon.frontend.openai.embeddings import EmbeddingRequest
from dynamod.daemon.frontend.openai.openapi_fields import bound_by_models, refine
from dynamod.daemon.frontend.openai.responses.schema import ResponsesRequest
from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest, CompletionRequest
from dynamod.daemon.frontend.pipeline.state import FrontendState

_REF = "#/components/schemas/{name}"
_ERROR = {"description": "an OpenAI-style error", "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorBody")}}}}
_JSON_OK = {"description": "success", "content": {"application/json": {"schema": {"type": "object"}}}}
_GENERATED_OK = {
    "description": "the completion: one JSON body, or server-sent events when ``stream`` is true",
    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}},
}

# request struct -> (path, operation id, summary, which model names the enum lists)
_GENERATION_ROUTES: list[tuple[type[msgspec.Struct], str, str, str, str]] = [
    (ChatCompletionRequest, "/v1/chat/completions", "createChatCompletion", "Chat completion", "chat"),
    (CompletionRequest, "/v1/completions", "createCompletion", "Text completion", "chat"),
    (EmbeddingRequest, "/v1/embeddings", "createEmbedding", "Embeddings", "embedding"),
    (ResponsesRequest, "/v1/responses", "createResponse", "Responses API", "chat"),
]


def _op(operation_id: str, summary: str, ok: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"operationId": operation_id, "summary": summary, "responses": {"200": ok, "default": _ERROR}, **extra}


@functools.lru_cache(maxsize=1)
def _static_document() -> dict[str, Any]:
    """Everything but the model enums and the security section (built once per process)."""
    structs = [route[0] for route in _GENERATION_ROUTES]
    refs, components = msgspec.json.schema_components([*structs, ErrorBody], ref_template=_REF)
    refine(components)  # the fields msgspec sees as Any, as the frontend's checks accept them
    paths: dict[str, Any] = {}
    for (struct, path, op_id, summary, _), ref in zip(_GENERATION_ROUTES, refs, strict=False):
        body = {"required": True, "content": {"application/json": {"schema": ref}}}
        paths[path] = {"post": _op(op_id, summary, _JSON_OK if struct is EmbeddingRequest else _GENERATED_OK, requestBody=body)}
    model_id = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}]
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}]
    paths["/v1/models"] = {"get": _op("listModels", "Models served now", _JSON_OK)}
    paths["/v1/models/{model_id}"] = {"get": _op("retrieveModel", "One served model", _JSON_OK, parameters=model_id)}
    paths["/v1/responses/{response_id}"] = {
        "get": _op("getResponse", "A stored response", _JSON_OK, parameters=response_id),
        "delete": _op("deleteResponse", "Forget a stored response", _JSON_OK, parameters=response_id),
    }
    paths["/health"] = {"get": _op("health", "Health (503 while shutting down)", _JSON_OK)}
    paths["/live"] = {"get": _op("live", "Liveness", _JSON_OK)}
    text = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths["/metrics"] = {"get": _op("metrics", "Prometheus metrics", text)}
    trace_params = [
        {"name": "request_id", "in": "query", "required": False, "schema": {"type": "string"}},
        {"name": "trace_id", "in": "query", "required": False, "schema": {"type": "string"}},
        {"name": "slowest", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0, "maximum": 10000}},
        {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0, "maximum": 10000}},
    ]
    paths["/v1/traces"] = {"get": _op(
        "listTraces", "Recent requests' trace spans (by request_id or trace_id), or the slowest recent requests",
        _JSON_OK, parameters=trace_params,
    )}
    paths["/openapi.json"] = {"get": _op("openapi", "This document", _JSON_OK)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "dynamod frontend (OpenAI-compatible)", "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }


def build_document(
    model_names: dict[str, list[str]], *, api_keys: bool, vocab_size: int | None = None,
    context_length: int | None = None,
) -> dict[str, Any]:
    """The document with ``model`` enums from ``model_names`` (kind -> names; an empty list
    leaves the field a plain string), token ids and output lengths bounded by the served models'
    ``vocab_size`` and ``context_length`` when known and, with ``api_keys``, the bearer scheme on
    every route but ``/live`` and ``/health``."""
    doc = copy.deepcopy(_static_document())
    schemas = doc["components"]["schemas"]
    bound_by_models(schemas, vocab_size=vocab_size, context_length=context_length)
    for struct, *_, kind in _GENERATION_ROUTES:
        names = model_names.get(kind) or []
        prop = schemas[struct.__name__]["properties"].get("model")
        if names and prop is not None and prop.get("type") == "string":
            prop["enum"] = sorted(names)
    if api_keys:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearerAuth": []}]
        for path in ("/live", "/health"):
            doc["paths"][path]["get"]["security"] = []
    return doc


class OpenApiEndpoint:
    """Serves the document of this frontend with the models served right now."""

    def __init__(self, state: FrontendState, *, api_keys: bool) -> None:
        self.state = state
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        registry = self.state.registry
        names = {"chat": list(registry.models), "embedding": list(registry.embedding_models)}
        contexts = [m.context_length for m in registry.models.values() if m.context_length]
        document = build_document(
            names, api_keys=self.api_keys, vocab_size=_smallest_vocab(registry),
            context_length=min(contexts) if contexts else None,
        )
        body = json.dumps(document).encode()
        await send_json(send, 200, body)


def _smallest_vocab(registry: Any) -> int | None:
    """The smallest vocabulary among the chat models whose tokenizer is loaded (None: none yet).
    Read without waiting: the document never holds a request up for a tokenizer load."""
    sizes = []
    for model in registry.models.values():
        task = model.preprocessor_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            sizes.append(task.result().vocab_size)
    return min(sizes) if sizes else None
