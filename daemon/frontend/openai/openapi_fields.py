"""The request fields msgspec sees as ``Any`` (or a bare list), spelled out in the OpenAPI document
the way the frontend's own checks accept them.

msgspec decodes and bounds every typed field, and ``openapi.py`` derives the document from the
same structs. What msgspec cannot type is checked by hand further on: chat messages and tools
(``preprocess/chat_template.py``), completion prompts (``preprocess``), Responses input items
(``responses/schema.py``), ``response_format`` and the vLLM fields no engine here honours
(``sampling.py``). Left as ``{}`` in the document, those fields read as "anything goes", which
misleads a client generating code from it and makes a schema fuzzer send requests that can only be
refused. Each shape below is what the matching check accepts; where that check depends on another
field (``best_of`` must equal ``n``), the shape says the value that is always accepted.
"""

from __future__ import annotations

from typing import Any

from dynamod.daemon.frontend.openai.responses.schema import INPUT_ROLES
from dynamod.daemon.frontend.openai.sampling import REFUSED_VLLM_FIELDS  # the values meaning "off"
from dynamod.daemon.frontend.preprocess.chat_template import ROLES

Schema = dict[str, Any]

_NULL: Schema = {"type": "null"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, _NULL], "default": None}


def _object(properties: dict[str, Schema], required: list[str]) -> Schema:
    """A closed object: the hand-written checks read these keys and no others."""
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_TEXT_PART = _object({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
_CONTENT: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_FUNCTION_NAME: Schema = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}

_TOOL_CALL = _object(
    {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": _object({"name": _FUNCTION_NAME, "arguments": {"type": "object"}}, ["name", "arguments"]),
    },
    ["type", "function"],
)

CHAT_MESSAGE: Schema = {
    "anyOf": [
        _object(
            {"role": {"enum": list(ROLES)}, "content": _CONTENT, "name": {"type": "string"},
             "tool_call_id": {"type": "string"}},
            ["role", "content"],
        ),
        # An assistant turn that only called tools has no content.
        _object(
            {"role": {"const": "assistant"}, "content": _NULL, "tool_calls": {"type": "array", "minItems": 1,
                                                                              "items": _TOOL_CALL}},
            ["role", "tool_calls"],
        ),
    ]
}

_CHAT_TOOL = _object(
    {
        "type": {"const": "function"},
        "function": _object(
            {"name": _FUNCTION_NAME, "description": {"type": "string"}, "parameters": {"type": "object"}}, ["name"]
        ),
    },
    ["type", "function"],
)

_TOKEN_ID: Schema = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
PROMPT: Schema = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        {"type": "array", "minItems": 1, "items": _TOKEN_ID},
        {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": _TOKEN_ID}},
    ]
}

_INPUT_MESSAGE = _object(
    {"type": {"const": "message"}, "role": {"enum": list(INPUT_ROLES)}, "content": _CONTENT}, ["role", "content"]
)
_INPUT_FUNCTION_CALL = _object(
    {"type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": _FUNCTION_NAME,
     "arguments": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"}}},
    ["type", "call_id", "name", "arguments"],
)
_INPUT_FUNCTION_OUTPUT = _object(
    {"type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": _CONTENT},
    ["type", "call_id", "output"],
)
RESPONSES_INPUT: Schema = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"anyOf": [_INPUT_MESSAGE, _INPUT_FUNCTION_CALL, _INPUT_FUNCTION_OUTPUT]}},
    ]
}

RESPONSE_FORMAT: Schema = {
    "anyOf": [
        _object({"type": {"enum": ["text", "json_object"]}}, ["type"]),
        _object(
            {
                "type": {"const": "json_schema"},
                "json_schema": _object(
                    {"name": {"type": "string"}, "description": {"type": "string"}, "schema": {"type": "object"},
                     "strict": {"type": "boolean"}},
                    ["schema"],
                ),
            },
            ["type", "json_schema"],
        ),
    ]
}

# Token ids as JSON object keys: decimal, in the token-id range.
_LOGIT_BIAS_KEYS: Schema = {"type": "string", "pattern": "^(0|[1-9][0-9]{0,8})$"}


def _accepted_values(values: tuple[Any, ...]) -> Schema:
    """A refused vLLM field: only null or the values that mean "off" (``sampling.py`` says why)."""
    enum: list[Any] = [None]
    for value in values:  # 1 and 1.0 are one JSON value
        if value not in enum:
            enum.append(value)
    return {"enum": enum, "default": None}


def refine(schemas: dict[str, Schema]) -> None:
    """Writes the shapes above into the msgspec-generated ``components.schemas``, in place."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["response_format"] = _nullable(RESPONSE_FORMAT)
        bias = props["logit_bias"]["anyOf"][0]
        bias["propertyNames"] = _LOGIT_BIAS_KEYS
        for field, values in REFUSED_VLLM_FIELDS.items():
            if field in props:
                props[field] = _accepted_values(values)
        props["allowed_token_ids"]["anyOf"][0]["minItems"] = 1  # an empty list allows no token at all
    chat = schemas["ChatCompletionRequest"]["properties"]
    chat["messages"] = {"type": "array", "minItems": 1, "items": CHAT_MESSAGE}
    chat["tools"] = _nullable({"type": "array", "items": _CHAT_TOOL})
    # A named function or "required" forces a call to a tool of ``tools``; these two never fail.
    chat["tool_choice"] = _nullable({"enum": ["none", "auto"]})
    completion = schemas["CompletionRequest"]["properties"]
    completion["prompt"] = PROMPT
    # Accepted only equal to ``n`` (candidates are not ranked here), which a schema cannot say.
    completion["best_of"] = {"type": "null", "default": None, "description": "accepted only unset or equal to n"}
    responses = schemas["ResponsesRequest"]["properties"]
    responses["input"] = RESPONSES_INPUT
    responses["tool_choice"] = {"enum": ["none", "auto"]}  # null is refused, the others need tools
    responses["truncation"] = _nullable({"const": "disabled"})  # "auto" is refused: no silent cuts


def bound_by_models(schemas: dict[str, Schema], *, vocab_size: int | None, context_length: int | None) -> None:
    """Bounds that depend on the models served now (the smallest of each): token ids below the
    vocabulary size (a larger one is refused as out of the vocabulary), and output lengths below
    the context length (prompt plus output must fit in it)."""
    if context_length:
        limits = {
            "ChatCompletionRequest": ("max_tokens", "max_completion_tokens", "min_tokens"),
            "CompletionRequest": ("max_tokens", "min_tokens"),
            "ResponsesRequest": ("max_output_tokens",),
        }
        for name, fields in limits.items():
            for field in fields:
                schemas[name]["properties"][field]["anyOf"][0]["maximum"] = context_length - 1
    if vocab_size:
        _bound_token_ids(schemas, vocab_size - 1)


def _bound_token_ids(schemas: dict[str, Schema], top: int) -> None:
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        for field in ("stop_token_ids", "allowed_token_ids"):
            props[field]["anyOf"][0]["items"]["maximum"] = top
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    prompt[2]["items"]["maximum"] = top
    prompt[3]["items"]["items"]["maximum"] = top
