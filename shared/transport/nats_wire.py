"""Messages, subjects and the connection helper of the NATS request plane.

A server with base subject ``B`` (its ``ServerAddress.address``, ``dynamod.rp.<server id>``) serves
each endpoint on ``B.rq.<endpoint path tokens>`` and takes control messages on ``B.ctl``.

- request, published to the endpoint's subject with a reply inbox:
  ``{endpoint, headers, body, request_id?, timeout_s?, credit, heartbeat_s}``;
- responses, published to that inbox: ``{seq, data | error | end}``, ``seq`` counting from 1 so
  the client sees a lost or reordered message as a gap; ``{seq: 0, hb: true}`` is a heartbeat the
  server sends on a stream with nothing else to say for ``heartbeat_s``, so a client notices a dead
  server within a few heartbeats; the client answers each heartbeat with a credit message, so the
  server notices a dead client the same way and cancels its handler;
- control, published to ``B.ctl``: ``{inbox, credit}`` (the total number of data messages the
  reader allows; totals, not increments, so a lost control message is repaired by the next one)
  or ``{inbox, cancel: true}``.

A request carries ``auth`` (the cluster token) when the process has one; a server with a token
refuses a request without the matching one (``unauthenticated``) before looking at its endpoint.
Who may publish at all is NATS's own auth (``connect`` logs in with ``NatsSecurity``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from dynamod.shared.errors import TransportError
from dynamod.shared.security import nats as nats_security
from dynamod.shared.security.settings import NatsSecurity

logger = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
SUBJECT_PREFIX = "dynamod.rp"
DEFAULT_HEARTBEAT_S = 1.0
MISSED_HEARTBEATS = 3  # a stream silent for this many heartbeats is treated as a lost server


class NatsRequest(msgspec.Struct, gc=False):
    endpoint: str
    headers: dict[str, str] | UnsetType = UNSET
    body: Any = UNSET
    request_id: str | UnsetType = UNSET
    timeout_s: float | UnsetType = UNSET
    credit: int | UnsetType = UNSET
    heartbeat_s: float | UnsetType = UNSET
    auth: str | UnsetType = UNSET


class NatsResponse(msgspec.Struct, gc=False):
    seq: int
    data: Any = UNSET
    error: dict[str, Any] | UnsetType = UNSET
    end: bool | UnsetType = UNSET
    hb: bool | UnsetType = UNSET


class NatsControl(msgspec.Struct, gc=False):
    inbox: str
    credit: int | UnsetType = UNSET
    cancel: bool | UnsetType = UNSET


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(NatsRequest)
response_decoder = msgspec.msgpack.Decoder(NatsResponse)
control_decoder = msgspec.msgpack.Decoder(NatsControl)


def _token(part: str) -> str:
    """One subject token: NATS separators and wildcards inside a name would change its meaning."""
    cleaned = part.replace(".", "_").replace("*", "_").replace(">", "_").replace(" ", "_")
    return cleaned or "_"


def endpoint_subject(base: str, endpoint_path: str) -> str:
    """``dynamo/backend/generate/1a2b`` served at ``B`` -> ``B.rq.dynamo.backend.generate.1a2b``."""
    return f"{base}.rq." + ".".join(_token(p) for p in endpoint_path.split("/"))


def control_subject(base: str) -> str:
    return f"{base}.ctl"


def resolve_nats_url(nats_url: str | None) -> str:
    """The URL given, else ``NATS_SERVER`` from the environment, else the local default."""
    return nats_url or os.environ.get("NATS_SERVER") or DEFAULT_NATS_URL


async def connect(
    url: str,
    *,
    name: str,
    reconnect_wait_s: float = 0.5,
    connect_timeout_s: float = 5.0,
    closing: Callable[[], bool] = lambda: False,
    security: NatsSecurity | None = None,
) -> Any:
    """A NATS connection that reconnects forever once established (the request plane outlives
    NATS restarts; nats-py replays subscriptions after each reconnect). The first connection must
    succeed within ``connect_timeout_s``: with unlimited reconnects nats-py would otherwise retry
    an unreachable server forever (``nats_connect``). ``security``: TLS and credentials (see
    ``shared.security.nats``)."""
    from nats.aio.client import Client as NatsClient

    from dynamod.shared.transport.nats_connect import connect_within

    options = nats_security.connect_options(security, url)

    errors: list[Exception] = []

    async def _error_cb(exc: Exception) -> None:
        # The error that says most about why a first connection keeps failing (``says_more``).
        if nats_security.says_more(exc, errors[0] if errors else None):
            errors[:] = [exc]
        logger.warning("request_plane.nats.error name=%s reason=%s", name, exc)

    async def _disconnected_cb() -> None:
        if not closing():
            logger.warning("request_plane.nats.disconnected name=%s url=%s", name, url)

    async def _reconnected_cb() -> None:
        logger.info("request_plane.nats.reconnected name=%s url=%s", name, url)

    nc = NatsClient()
    try:
        await connect_within(
            nc.connect(
                url,
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
                connect_timeout=min(2.0, connect_timeout_s),  # type: ignore[arg-type]
                error_cb=_error_cb,
                disconnected_cb=_disconnected_cb,
                reconnected_cb=_reconnected_cb,
                **options,
            ),
            connect_timeout_s,
            nc.close,
            what=f"request plane nats ({name})",
        )
    except Exception as exc:  # noqa: BLE001 - nats-py raises several unrelated types here
        hint = nats_security.refusal_hint(errors[0] if errors else exc)
        raise TransportError(
            f"cannot connect to NATS at {url}: {exc or type(exc).__name__}" + (f"; {hint}" if hint else "")
        ) from exc
    refusal = nats_security.tls_missing(nc, url, security)
    if refusal is not None:
        await nc.close()
        raise TransportError(refusal)
    return nc
