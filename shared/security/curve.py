"""CURVE keys of the ZMQ event plane, derived from the cluster token.

A ZMQ publisher binds a PUB socket that anyone who reaches the port could read (every worker's KV
events, load and routing decisions), and a subscriber dials whatever address discovery names, so a
process able to register a channel key could feed forged events to routers. With the cluster token
configured, both ends speak CURVE: the publisher is a CURVE server whose key pair only members can
compute, and it admits (through a ZAP handler, see ``zmq_gate``) only clients presenting the member
client key. A non-member can neither read a publisher nor pass itself off as one.

Why derive rather than distribute key files: the token is already on every member (file or
``DYN_CLUSTER_TOKEN``), so there is nothing new to deploy or rotate; rotating the token rotates
these keys. HKDF-SHA256 with distinct ``info`` labels gives independent server and client secrets,
and neither reveals the token. Every member shares both pairs: membership is knowing the token,
exactly as on the request plane.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import zmq
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.token import ClusterToken

_SALT = b"dynamod zmq event plane curve v1"
_SERVER_INFO = b"server"
_CLIENT_INFO = b"client"
ZAP_DOMAIN = b"dynamod-events"


def _derive_secret(token: ClusterToken, info: bytes) -> bytes:
    """A Z85-encoded Curve25519 secret key (32 bytes; libsodium clamps it when it uses it)."""
    raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(token.value.encode())
    return z85.encode(raw)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The member key pairs (Z85, as libzmq takes them). ``repr`` shows only public keys."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: ClusterToken) -> CurveKeys:
        if not zmq.has("curve"):
            raise ConfigError(
                "the cluster token turns on CURVE for the zmq event plane, but this libzmq was built "
                "without it: install pyzmq's bundled wheel, or use --event-plane nats"
            )
        server_secret = _derive_secret(token, _SERVER_INFO)
        client_secret = _derive_secret(token, _CLIENT_INFO)
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def admits(self, client_public_z85: bytes) -> bool:
        """Whether a client presenting this public key is a member (constant-time compare)."""
        return hmac.compare_digest(client_public_z85, self.client_public)

    def make_server(self, sock: zmq.Socket) -> None:
        """Turns ``sock`` into a CURVE server; set before ``bind`` (libzmq reads it per connection)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def make_client(self, sock: zmq.Socket) -> None:
        """Makes ``sock`` a CURVE client of a member server; set before ``connect``. A peer whose
        server key differs (a forged publisher) fails the handshake and delivers nothing."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"


def event_plane_curve(token: ClusterToken | None) -> CurveKeys | None:
    """The event plane's keys: CURVE on exactly when the cluster token is configured."""
    return CurveKeys.from_token(token) if token is not None else None
