"""Request bodies of every API surface: strict msgspec structs, decoded in one pass into a 400.

A body is decoded and validated at once (``msgspec.json.decode(body, type=...)``), so a wrong type
or an out-of-range number becomes an ``InvalidRequestError`` naming the parameter, and an unknown
field is refused by name (``RequestBody`` forbids them): a misspelt field must not be served as if
it had been honoured. Each surface (OpenAI, Anthropic) declares its structs on ``RequestBody`` and
passes its own hints for the unknown fields its clients are likely to send.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from dynamod.shared.errors import InvalidRequestError


class RequestBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every struct decoded from a client's request body: unknown fields are refused."""


_PATH_RE = re.compile(r"(?:at|in) `\$\.?([^`]*)`")  # "in" for a bad key: "at `key` in `$.logit_bias`"


def _param_of(message: str) -> str | None:
    match = _PATH_RE.search(message)
    return match.group(1) or None if match else None


def decode_body(decoder: msgspec.json.Decoder, body: bytes, hints: Mapping[str, str] | None = None) -> Any:
    """``body`` decoded by ``decoder``; ``InvalidRequestError`` naming the parameter otherwise.
    ``hints``: for an unknown field by name, what to do instead (added to the message)."""
    if not body:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = _param_of(message)
        field = message.split("`")[1] if "`" in message else None
        if message.startswith("Object missing required field"):
            where = f"{param}.{field}" if param else field
            raise InvalidRequestError(f"missing required parameter: {where}", param=where) from None
        if message.startswith("Object contains unknown field") and field is not None:
            where = f"{param}.{field}" if param else field
            hint = (hints or {}).get(field)
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {where}" + (f" ({hint})" if hint else ""), param=where
            ) from None
        raise InvalidRequestError(f"invalid parameter: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("the request body nests JSON too deeply") from None
