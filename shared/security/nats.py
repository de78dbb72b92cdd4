"""How this process logs in to NATS: nats-py connect options from ``NatsSecurity``, in one place
for the event plane and the NATS request plane.

nats-py upgrades to TLS only when the server's INFO says ``tls_required``; a process configured
for TLS must not quietly carry on in plaintext with a server that does not, so ``tls_missing``
refuses such a connection right after it is made. That check comes too late for a man in the
middle, though: the server's INFO arrives in plaintext, and one that drops ``tls_required`` makes
nats-py send CONNECT (user, password or token) in the clear before ``tls_missing`` runs, on every
reconnect too. ``--nats-tls-handshake-first`` closes that: the client starts TLS before reading
anything (nats-py ``tls_handshake_first``), and a server that answers with a plaintext INFO fails
the handshake. The server must be configured for it (``handshake_first`` in its tls block; a
duration there, as in ``deploy/config/nats-server.conf``, still serves INFO-first clients).
"""

from __future__ import annotations

import logging
from typing import Any

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.settings import NatsSecurity
from dynamod.shared.security.tls import TlsFiles, client_context

logger = logging.getLogger(__name__)
_warned_strippable = False


def wants_tls(url: str, security: NatsSecurity | None) -> bool:
    return bool(security and security.tls_enabled) or any(
        u.strip().lower().startswith("tls://") for u in url.split(",")
    )


def connect_options(security: NatsSecurity | None, url: str = "") -> dict[str, Any]:
    """Keyword arguments for ``nats.connect``: the TLS context (handshake first when asked) and one
    kind of credentials. ``url``: the servers, to know whether a ``tls://`` URL asks for TLS."""
    global _warned_strippable
    if security is None:
        return {}
    opts: dict[str, Any] = {}
    if security.tls_enabled:
        opts["tls"] = client_context(security.tls, what="NATS")
    if security.tls_handshake_first:
        if "tls" not in opts:
            # A tls:// URL without --nats-ca-file: verify against the system's roots.
            opts["tls"] = client_context(TlsFiles(), what="NATS")
        opts["tls_handshake_first"] = True
    elif wants_tls(url, security) and not _warned_strippable:
        _warned_strippable = True
        logger.warning(
            "nats.tls_strippable reason=server INFO is read in plaintext, a man in the middle can drop "
            "tls_required and read the login and the traffic hint=set --nats-tls-handshake-first (DYN_NATS_TLS_HANDSHAKE_FIRST=1) "
            "and handshake_first in the server's tls block"
        )
    if security.user:
        opts["user"] = security.user
        opts["password"] = security.password
    if security.token:
        opts["token"] = security.token
    if security.nkey_seed_file or security.creds_file:
        try:
            import nkeys  # noqa: F401 - nats-py signs with it; fail here, not inside connect
        except ImportError as exc:
            raise ConfigError(
                "NATS NKey and credentials-file auth need the 'nkeys' package: pip install 'nats-py[nkeys]'"
            ) from exc
    if security.nkey_seed_file:
        opts["nkeys_seed"] = security.nkey_seed_file
    if security.creds_file:
        opts["user_credentials"] = security.creds_file
    return opts


def tls_missing(nc: Any, url: str, security: NatsSecurity | None) -> str | None:
    """A reason to refuse ``nc`` when TLS was asked for and the server did not use it, else None."""
    if not wants_tls(url, security):
        return None
    info = getattr(nc, "_server_info", None) or {}
    if info.get("tls_required"):
        return None
    return (
        f"NATS at {url} does not use TLS but this process is configured for it "
        "(--nats-ca-file / tls:// URL): refusing to send events and requests in the clear"
    )


def _refusal_rank(exc: BaseException | None) -> int:
    """2: the server refused the credentials; 1: TLS failed; 0: anything else (or nothing)."""
    hint = refusal_hint(exc)
    return 2 if hint.startswith("NATS refused the credentials") else 1 if hint else 0


def says_more(new: BaseException, kept: BaseException | None) -> bool:
    """Whether ``new`` should replace ``kept`` as the error that explains a failing first connect:
    a refusal says more than the broken pipes of the retries after it, and a credentials refusal
    more than a TLS error (over TLS the server sends its authorization error and closes, and a
    retry can then see only the TLS close)."""
    return _refusal_rank(new) >= _refusal_rank(kept)


def refusal_hint(exc: BaseException | None) -> str:
    """What to check when NATS refused the connection for its credentials or TLS; '' otherwise."""
    text = f"{type(exc).__name__}: {exc}".lower() if exc is not None else ""
    if "authorization" in text or "authentication" in text:
        return (
            "NATS refused the credentials: check --nats-user/--nats-password-file, --nats-token-file, "
            "--nats-nkey-seed-file or --nats-creds-file"
        )
    if "ssl" in text or "certificate" in text or "tls" in text:
        return "TLS with NATS failed: check --nats-ca-file (and --nats-cert-file/--nats-key-file if it verifies clients)"
    return ""
