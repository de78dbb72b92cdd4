"""How this process logs in to NATS: nats-py connect options from ``NatsSecurity``, in one place
for the event plane and the NATS request plane.

nats-py upgrades to TLS only when the server's INFO says ``tls_required``; a process configured
for TLS must not quietly carry on in plaintext with a server that does not, so ``check_tls``
refuses such a connection right after it is made.
"""

from __future__ import annotations

from typing import Any

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.settings import NatsSecurity
from dynamod.shared.security.tls import client_context


def wants_tls(url: str, security: NatsSecurity | None) -> bool:
    return bool(security and security.tls_enabled) or any(
        u.strip().lower().startswith("tls://") for u in url.split(",")
    )


def connect_options(security: NatsSecurity | None) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect``: the TLS context and one kind of credentials."""
    if security is None:
        return {}
    opts: dict[str, Any] = {}
    if security.tls_enabled:
        opts["tls"] = client_context(security.tls, what="NATS")
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
