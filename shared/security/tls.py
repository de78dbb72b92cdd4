"""TLS contexts for the cluster's connections, built once from PEM files.

One place decides the protocol floor (TLS 1.2), how certificates are verified and what a bad file
means to the operator: a ``ConfigError`` naming the file, at start-up, rather than a handshake
failure on the first request. Both ends verify the peer against the cluster CA; servers ask for a
client certificate only when told to (mutual TLS).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

from dynamod.shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one TLS identity: the CA that verifies peers, and this process's certificate
    and key (the key may also be inside the certificate file). Any may be None."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def any(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)

    def check(self, what: str) -> TlsFiles:
        """Raises ConfigError when a named file is missing or a key comes without a certificate."""
        for flag, path in (("CA", self.ca_file), ("certificate", self.cert_file), ("key", self.key_file)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{what}: TLS {flag} file {path!r} does not exist")
        if self.key_file and not self.cert_file:
            raise ConfigError(f"{what}: a TLS key file needs its certificate file too")
        return self


def _load_chain(ctx: ssl.SSLContext, files: TlsFiles, what: str) -> None:
    if not files.cert_file:
        return
    try:
        ctx.load_cert_chain(files.cert_file, files.key_file)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{what}: cannot load certificate {files.cert_file!r} with key {files.key_file or '(in the same file)'!r}: {exc}"
        ) from exc


def _load_ca(ctx: ssl.SSLContext, files: TlsFiles, what: str) -> None:
    try:
        if files.ca_file:
            ctx.load_verify_locations(cafile=files.ca_file)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)  # no cluster CA: trust the system's roots
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot load TLS CA file {files.ca_file!r}: {exc}") from exc


def server_context(files: TlsFiles, *, require_client_cert: bool, what: str) -> ssl.SSLContext:
    """A server-side context presenting ``cert_file``. With ``require_client_cert`` a client must
    present a certificate signed by ``ca_file`` or the handshake fails (mutual TLS)."""
    files.check(what)
    if not files.cert_file:
        raise ConfigError(f"{what}: serving TLS needs a certificate and key (--tls-cert-file, --tls-key-file)")
    if require_client_cert and not files.ca_file:
        raise ConfigError(f"{what}: requiring client certificates needs the CA that signs them (--tls-ca-file)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, files, what)
    if files.ca_file:
        _load_ca(ctx, files, what)
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
    return ctx


def client_context(files: TlsFiles, *, check_hostname: bool = True, what: str) -> ssl.SSLContext:
    """A client-side context that verifies the server against ``ca_file`` (the system's roots
    without one) and presents ``cert_file`` when given (for servers that require client certs).
    ``check_hostname`` False still verifies the chain, only not the name in it."""
    files.check(what)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_ca(ctx, files, what)
    _load_chain(ctx, files, what)
    return ctx


def read_pem(path: str | None, what: str) -> bytes | None:
    """A PEM file's bytes (gRPC takes bytes, not paths); ConfigError naming the file otherwise."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc}") from exc
