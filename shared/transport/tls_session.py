"""Server-side TLS of one request-plane connection, run inside the connection's own protocol.

Why not ``create_server(ssl=...)`` or ``loop.start_tls``: with the loop's TLS a failed handshake
(a client without a certificate, a plaintext client, a stranger's CA) never reaches the protocol,
so it could be neither counted nor logged; and uvloop starts reading right after
``connection_made``, so bytes of the TLS hello would reach a protocol that ``start_tls`` has not
swapped in yet. Owning the ``SSLObject`` (memory BIOs, as asyncio's own ``sslproto`` does) keeps
the refusal in our hands on both loops, and the alert OpenSSL writes is sent before closing, so the
client learns why ("certificate required") instead of seeing a reset.
"""

from __future__ import annotations

import ssl

_READ_CHUNK = 256 * 1024


class TlsClosed(Exception):
    """The peer ended the TLS session (close_notify)."""


class ServerTlsSession:
    """Decrypts what the socket delivers and encrypts what the connection writes."""

    __slots__ = ("_in", "_obj", "_out", "handshaken")

    def __init__(self, context: ssl.SSLContext) -> None:
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_side=True)
        self.handshaken = False

    def receive(self, data: bytes) -> bytes:
        """Feeds ciphertext; returns the plaintext it completed (b"" while handshaking). Raises
        ``ssl.SSLError`` when the handshake fails or a record is bad, ``TlsClosed`` at close_notify.
        Afterwards ``outgoing()`` holds what must be sent (handshake messages, alerts, tickets)."""
        self._in.write(data)
        if not self.handshaken:
            try:
                self._obj.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self.handshaken = True
        chunks = []
        while True:
            try:
                chunk = self._obj.read(_READ_CHUNK)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError as exc:
                raise TlsClosed() from exc
            if not chunk:
                break
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def send(self, plaintext: bytes | bytearray) -> bytes:
        """Encrypts ``plaintext``; returns the records to write (plus anything already pending)."""
        if plaintext:
            self._obj.write(plaintext)
        return self._out.read()

    def outgoing(self) -> bytes:
        return self._out.read()

    def close_notify(self) -> bytes:
        """The close_notify alert to send before closing, so the client sees a clean end."""
        if self.handshaken:
            try:
                self._obj.unwrap()
            except (ssl.SSLWantReadError, ssl.SSLError):
                pass
        return self._out.read()

    def peer_certificate_subject(self) -> str:
        cert = self._obj.getpeercert() if self.handshaken else None
        if not cert:
            return ""
        for rdn in cert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    return str(value)
        return ""
