"""A request's priority as Dynamo reads it: ``nvext.agent_hints.priority`` in the body, or the
``x-dynamo-request-priority`` header, which wins when both are given (Dynamo's rule; the header is
how a client whose SDK cannot add body fields, the Anthropic SDK on ``/v1/messages`` for one, sets
it). Higher is more urgent; 0 or absent is the default.

The body field is validated by the schema (an integer within 32 bits, else a 400 naming
``nvext.agent_hints.priority``); the header is validated here, with the same bounds.
"""

from __future__ import annotations

import re

import msgspec

from dynamod.daemon.frontend.http.asgi import Scope, header
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import RoutingHints

PRIORITY_HEADER = b"x-dynamo-request-priority"
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_INTEGER = re.compile(r"[+-]?[0-9]{1,12}")  # no "1_000", no "1e3", no floats


def header_priority(scope: Scope) -> int | None:
    """The ``x-dynamo-request-priority`` header as an integer; None when absent.
    ``InvalidRequestError`` (400) when it is not a 32-bit integer."""
    raw = header(scope, PRIORITY_HEADER)
    if raw is None:
        return None
    text = raw.strip()
    if _INTEGER.fullmatch(text) is None:
        raise InvalidRequestError(
            f"header x-dynamo-request-priority must be an integer, got {raw!r}", param="x-dynamo-request-priority"
        )
    value = int(text)
    if not _I32_MIN <= value <= _I32_MAX:
        raise InvalidRequestError(
            f"header x-dynamo-request-priority must be within [{_I32_MIN}, {_I32_MAX}], got {value}",
            param="x-dynamo-request-priority",
        )
    return value


def with_header_priority(routing: RoutingHints | None, scope: Scope) -> RoutingHints | None:
    """``routing`` (the body's hints) with the header's priority in place of the body's, if sent."""
    priority = header_priority(scope)
    if priority is None:
        return routing
    if routing is None:
        return RoutingHints(priority=priority)
    return msgspec.structs.replace(routing, priority=priority)
