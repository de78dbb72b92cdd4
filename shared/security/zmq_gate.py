"""The ZAP handler of a ZMQ context: admits CURVE clients holding the member key, refuses the rest.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` in the socket's context about every
new CURVE peer (ZAP, RFC 27) and closes the connection on anything but ``200``. Without a handler,
a CURVE server admits any client that knows its public key; with this one a client must also hold
the member client secret (derived from the cluster token, see ``curve``).

Written here rather than using ``zmq.auth.asyncio.AsyncioAuthenticator`` because a refusal should
be counted and logged with the peer's address, once per peer per minute (``RejectionLog``, as on
the request plane), and the pyzmq authenticator's credentials callback is never told the address.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils import z85

from dynamod.shared.security.curve import CurveKeys
from dynamod.shared.security.token import RejectionLog
from dynamod.shared.tasks import stop_task

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"
REASON_NOT_CURVE = "not_curve"
REASON_UNKNOWN_KEY = "unknown_key"


class CurveGate:
    """Serves ZAP for one context; ``start`` before any CURVE server socket binds in it."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: CurveKeys, *, what: str = "event_plane.zmq") -> None:
        self._ctx = ctx
        self._keys = keys
        self._log = RejectionLog(what)
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.admitted = 0
        self.rejected = 0

    def start(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)  # bind is synchronous: servers bound after this find the handler
        self._socket = sock
        self._task = asyncio.create_task(self._serve(), name="zmq-zap")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _serve(self) -> None:
        assert self._socket is not None
        sock = self._socket
        while True:
            request = await sock.recv_multipart()
            await sock.send_multipart(self.answer(request))

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply frames for one request (RFC 27: version, request id, status, text, user
        id, metadata)."""
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return [_ZAP_VERSION, request_id, b"400", b"malformed ZAP request", b"", b""]
        _version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        peer = address.decode("utf-8", "replace") or "?"
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return self._refuse(request_id, peer, REASON_NOT_CURVE, mechanism.decode("ascii", "replace"))
        if not self._keys.admits(z85.encode(credentials[0])):
            return self._refuse(request_id, peer, REASON_UNKNOWN_KEY, "")
        self.admitted += 1
        return [_ZAP_VERSION, request_id, b"200", b"OK", b"member", b""]

    def _refuse(self, request_id: bytes, peer: str, reason: str, detail: str) -> list[bytes]:
        self.rejected += 1
        self._log.rejected(peer, reason, detail)
        return [_ZAP_VERSION, request_id, b"400", b"not a member of this cluster", b"", b""]
