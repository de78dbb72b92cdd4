"""``x-request-id``: the client's id for its request (or one we make), echoed on every response.

The doors (``request_checks.FrontDoors``) call ``assign``: a header that is present must be 1..128
printable ASCII characters (else a 400 before anything else happens); without one the frontend
makes a UUID. The id is kept in the ASGI scope, and ``send`` is wrapped so that the response's
headers carry it whatever route or error path answers. The generation endpoints tag their trace
spans and log lines with it, and pass it to the workers in the request-plane headers.
"""

from __future__ import annotations

import uuid
from typing import Any

from dynamod.daemon.frontend.http.asgi import Scope, header
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.observability.tracing import MAX_REQUEST_ID_LEN, REQUEST_ID_HEADER, valid_request_id

REQUEST_ID_HEADER_B = REQUEST_ID_HEADER.encode("latin-1")
SCOPE_REQUEST_ID = "dynamod.request_id"
SCOPE_REQUEST_ID_GIVEN = "dynamod.request_id_given"  # True: the client sent it (it may repeat across requests)


def assign(scope: Scope) -> str:
    """The request's id, stored in the scope; raises ``InvalidRequestError`` for a bad header."""
    given = header(scope, REQUEST_ID_HEADER_B)
    if given is None:
        rid = uuid.uuid4().hex
    elif valid_request_id(given):
        rid = given
    else:
        raise InvalidRequestError(
            f"x-request-id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters without leading or "
            "trailing spaces",
            param="x-request-id",
        )
    scope[SCOPE_REQUEST_ID] = rid
    scope[SCOPE_REQUEST_ID_GIVEN] = given is not None
    return rid


def request_id_of(scope: Scope) -> str | None:
    return scope.get(SCOPE_REQUEST_ID)


def echoing_send(send: Any, rid: str) -> Any:
    """``send`` with ``x-request-id: rid`` added to the response start. A plain function returning
    the inner ``send``'s awaitable, not a coroutine of its own: it runs for every chunk of a stream."""
    value = rid.encode("latin-1")

    def send_with_id(message: dict[str, Any]) -> Any:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers") or ())
            headers.append((REQUEST_ID_HEADER_B, value))
            message = {**message, "headers": headers}
        return send(message)

    return send_with_id
