"""The ``embed`` endpoint's wire types (msgpack on the request plane).

An embedding worker serves ``embed`` where a generating worker serves ``generate``; its model
card has model type ``embedding`` and is published under ``v1/mdc/{ns}/{component}/embed/{id}``,
so a frontend's client for the card's endpoint reaches exactly the workers that can embed.

As with ``generate``, the frontend tokenizes: a request carries token ids, one list per input.
The reply is one frame. Each vector travels as raw float32 little-endian bytes: a quarter of the
size of a msgpack float list, no per-element encoding on either side, and exactly the bytes
OpenAI's ``encoding_format: "base64"`` asks for, so the frontend base64-encodes them as they are.
"""

from __future__ import annotations

import msgspec

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.model_card import EmbeddingSpec

EMBED_ENDPOINT = "embed"
VECTOR_DTYPE = "<f4"  # numpy dtype of a vector on the wire: float32, little-endian


class EmbedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    model: str
    inputs: list[list[int]]  # token ids, one list per input, in the client's order
    dimensions: int | None = None  # truncate (and re-normalise) to this many; None: the model's own
    lora_name: str | None = None


class EmbedResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    embeddings: list[bytes]  # one float32 little-endian vector per input, in the request's order
    dimensions: int
    prompt_tokens: int = 0  # tokens embedded, over all inputs


def resolve_dimensions(requested: int | None, spec: EmbeddingSpec) -> int:
    """The vector length to return, or ``InvalidRequestError`` naming ``dimensions``. Shared by the
    frontend (refuse before routing) and the engines (refuse a direct caller too)."""
    if requested is None:
        return spec.dimensions
    if not spec.matryoshka and requested != spec.dimensions:
        raise InvalidRequestError(
            f"this model returns {spec.dimensions}-dimensional embeddings and cannot shorten them "
            f"(not a Matryoshka model); leave 'dimensions' unset", param="dimensions",
        )
    if not 1 <= requested <= spec.dimensions:
        raise InvalidRequestError(
            f"'dimensions' must be between 1 and {spec.dimensions} for this model, got {requested}", param="dimensions"
        )
    if spec.matryoshka_dimensions and requested not in spec.matryoshka_dimensions:
        allowed = ", ".join(str(d) for d in spec.matryoshka_dimensions)
        raise InvalidRequestError(f"this model supports 'dimensions' of {allowed} only, got {requested}", param="dimensions")
    return requested
