"""The security settings of every role, ``dynamoctl`` and ``dynamo-console``: one definition of
the flags, their ``DYN_*`` environment fallbacks and their meaning.

Three doors, each configured on its own because each is usually run by someone else:

- the request plane (this project's TCP listeners): TLS with the cluster CA (``--tls-*``),
  optionally mutual, and/or the cluster token (``--cluster-token-file`` / ``DYN_CLUSTER_TOKEN``);
- etcd: ``https://`` endpoints, its CA and a client certificate, and/or user + password;
- NATS: ``tls://`` URLs, its CA and a client certificate, and token, user + password, an NKey
  seed or a credentials file.

Secrets come from files or the environment, never from flags (see ``secrets``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.secrets import resolve_secret
from dynamod.shared.security.tls import TlsFiles
from dynamod.shared.security.token import ClusterToken

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class RequestPlaneSecurity:
    """TLS and token of the TCP request plane; empty means plaintext and open (loopback dev)."""

    tls: TlsFiles = field(default_factory=TlsFiles)
    require_client_cert: bool = False
    verify_hostname: bool = True
    token: ClusterToken | None = None

    @property
    def tls_enabled(self) -> bool:
        return self.tls.any

    @property
    def enabled(self) -> bool:
        return self.tls_enabled or self.token is not None

    def describe(self) -> str:
        parts = []
        if self.tls_enabled:
            parts.append("mtls" if self.require_client_cert else "tls")
        if self.token is not None:
            parts.append("token")
        return "+".join(parts) or "none"


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """TLS files for ``https://`` etcd endpoints and the user etcd's auth knows this process as."""

    tls: TlsFiles = field(default_factory=TlsFiles)
    user: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        return f"EtcdSecurity(tls={self.tls!r}, user={self.user!r}, password={'***' if self.password else None})"


@dataclass(frozen=True, slots=True)
class NatsSecurity:
    """TLS files and one kind of credentials for the NATS server."""

    tls: TlsFiles = field(default_factory=TlsFiles)
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed_file: str | None = None
    creds_file: str | None = None
    # TLS before the server's first word (nats-server 2.10+ ``handshake_first``): nothing, not even
    # the INFO that says whether TLS is required, crosses in plaintext, so it cannot be stripped.
    tls_handshake_first: bool = False

    @property
    def tls_enabled(self) -> bool:
        return self.tls.any

    def __repr__(self) -> str:
        return (
            f"NatsSecurity(tls={self.tls!r}, user={self.user!r}, password={'***' if self.password else None}, "
            f"token={'***' if self.token else None}, nkey_seed_file={self.nkey_seed_file!r}, "
            f"creds_file={self.creds_file!r}, tls_handshake_first={self.tls_handshake_first!r})"
        )


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    request_plane: RequestPlaneSecurity = field(default_factory=RequestPlaneSecurity)
    etcd: EtcdSecurity = field(default_factory=EtcdSecurity)
    nats: NatsSecurity = field(default_factory=NatsSecurity)


# flag dest -> (flag, env var, help). Every flag is a path, a name or a switch: values of secrets
# live only in files or the environment.
_FLAGS: dict[str, tuple[str, str, str]] = {
    "cluster_token_file": (
        "--cluster-token-file",
        "DYN_CLUSTER_TOKEN_FILE",
        "file holding the cluster token every request-plane peer must present (or the token itself in "
        "DYN_CLUSTER_TOKEN)",
    ),
    "tls_ca_file": ("--tls-ca-file", "DYN_TLS_CA_FILE", "request plane: CA (PEM) that verifies peers; turns TLS on"),
    "tls_cert_file": (
        "--tls-cert-file",
        "DYN_TLS_CERT_FILE",
        "request plane: this process's certificate (PEM), served and presented to servers; turns TLS on",
    ),
    "tls_key_file": ("--tls-key-file", "DYN_TLS_KEY_FILE", "request plane: the certificate's private key (PEM)"),
    "etcd_ca_file": ("--etcd-ca-file", "DYN_ETCD_CA_FILE", "CA (PEM) of https:// etcd endpoints"),
    "etcd_cert_file": ("--etcd-cert-file", "DYN_ETCD_CERT_FILE", "client certificate (PEM) for etcd"),
    "etcd_key_file": ("--etcd-key-file", "DYN_ETCD_KEY_FILE", "its private key (PEM)"),
    "etcd_user": ("--etcd-user", "DYN_ETCD_USER", "etcd user (etcd auth enabled)"),
    "etcd_password_file": (
        "--etcd-password-file",
        "DYN_ETCD_PASSWORD_FILE",
        "file holding that user's password (or the password in DYN_ETCD_PASSWORD)",
    ),
    "nats_ca_file": ("--nats-ca-file", "DYN_NATS_CA_FILE", "CA (PEM) of the NATS server; turns TLS on"),
    "nats_cert_file": ("--nats-cert-file", "DYN_NATS_CERT_FILE", "client certificate (PEM) for NATS"),
    "nats_key_file": ("--nats-key-file", "DYN_NATS_KEY_FILE", "its private key (PEM)"),
    "nats_user": ("--nats-user", "DYN_NATS_USER", "NATS user"),
    "nats_password_file": (
        "--nats-password-file",
        "DYN_NATS_PASSWORD_FILE",
        "file holding that user's password (or the password in DYN_NATS_PASSWORD)",
    ),
    "nats_token_file": (
        "--nats-token-file",
        "DYN_NATS_TOKEN_FILE",
        "file holding the NATS authorization token (or the token in DYN_NATS_TOKEN)",
    ),
    "nats_nkey_seed_file": ("--nats-nkey-seed-file", "DYN_NATS_NKEY_SEED_FILE", "NKey seed file for NATS"),
    "nats_creds_file": ("--nats-creds-file", "DYN_NATS_CREDS_FILE", "NATS credentials file (JWT + NKey seed)"),
}
SECRET_FILE_VARS = frozenset(env for flag, env, _ in _FLAGS.values() if flag.endswith("-file"))
"""The ``DYN_*_FILE`` variables naming files a process reads its TLS material and secrets from."""
SECRET_VALUE_VARS = frozenset({"DYN_CLUSTER_TOKEN", "DYN_ETCD_PASSWORD", "DYN_NATS_PASSWORD", "DYN_NATS_TOKEN"})
"""Variables holding a secret itself: fine in a process's environment, never on a command line."""

_SWITCHES: dict[str, tuple[str, str, str]] = {
    "tls_require_client_cert": (
        "--tls-require-client-cert",
        "DYN_TLS_REQUIRE_CLIENT_CERT",
        "request plane: refuse clients without a certificate signed by --tls-ca-file (mutual TLS)",
    ),
    "tls_skip_hostname_check": (
        "--tls-skip-hostname-check",
        "DYN_TLS_SKIP_HOSTNAME_CHECK",
        "request plane: verify a server's certificate chain but not that it names the dialled address "
        "(addresses not in the certificates, e.g. pod IPs)",
    ),
    "nats_tls_handshake_first": (
        "--nats-tls-handshake-first",
        "DYN_NATS_TLS_HANDSHAKE_FIRST",
        "NATS: start TLS before the server's INFO, so a man in the middle cannot strip TLS and read the "
        "login; the server needs 'handshake_first' in its tls block (nats-server 2.10+)",
    ),
}


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """The security flags, in their own ``--help`` group. Defaults are all off."""
    g = parser.add_argument_group(
        "security (request plane, etcd, NATS; all off by default: see README 'Securing a cluster')"
    )
    for dest, (flag, env, text) in _FLAGS.items():
        g.add_argument(flag, dest=dest, metavar="PATH" if dest.endswith("_file") else "NAME",
                       help=f"{text} [env {env}, default none]")
    for dest, (flag, env, text) in _SWITCHES.items():
        g.add_argument(flag, dest=dest, action="store_const", const=True, help=f"{text} [env {env}=1, default off]")


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _switch(ns: argparse.Namespace, dest: str) -> bool:
    if getattr(ns, dest, None):
        return True
    env = _SWITCHES[dest][1]
    raw = _env(env)
    if raw is None:
        return False
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{env}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def security_from_args(ns: argparse.Namespace | None = None) -> SecuritySettings:
    """Flags, then ``DYN_*`` environment; reads the secret files now, so a missing or empty file is
    one clear ConfigError at start-up. ``ns`` None: from the environment alone."""
    ns = ns if ns is not None else argparse.Namespace()

    def pick(dest: str) -> str | None:
        value = getattr(ns, dest, None)
        return str(value) if value else _env(_FLAGS[dest][1])

    token_value = resolve_secret(
        file=pick("cluster_token_file"), value=_env("DYN_CLUSTER_TOKEN"), what="cluster token",
        file_flag="--cluster-token-file", env="DYN_CLUSTER_TOKEN",
    )
    request_plane = RequestPlaneSecurity(
        tls=TlsFiles(pick("tls_ca_file"), pick("tls_cert_file"), pick("tls_key_file")).check("request plane"),
        require_client_cert=_switch(ns, "tls_require_client_cert"),
        verify_hostname=not _switch(ns, "tls_skip_hostname_check"),
        token=ClusterToken(token_value) if token_value else None,
    )
    if request_plane.require_client_cert and not request_plane.tls.ca_file:
        raise ConfigError("--tls-require-client-cert needs --tls-ca-file (the CA that signs member certificates)")
    etcd_user = pick("etcd_user")
    etcd_password = resolve_secret(
        file=pick("etcd_password_file"), value=_env("DYN_ETCD_PASSWORD"), what="etcd password",
        file_flag="--etcd-password-file", env="DYN_ETCD_PASSWORD",
    )
    if bool(etcd_user) != bool(etcd_password):
        raise ConfigError("etcd auth needs both --etcd-user and a password (--etcd-password-file / DYN_ETCD_PASSWORD)")
    etcd = EtcdSecurity(
        tls=TlsFiles(pick("etcd_ca_file"), pick("etcd_cert_file"), pick("etcd_key_file")).check("etcd"),
        user=etcd_user,
        password=etcd_password,
    )
    nats = NatsSecurity(
        tls=TlsFiles(pick("nats_ca_file"), pick("nats_cert_file"), pick("nats_key_file")).check("NATS"),
        user=pick("nats_user"),
        password=resolve_secret(
            file=pick("nats_password_file"), value=_env("DYN_NATS_PASSWORD"), what="NATS password",
            file_flag="--nats-password-file", env="DYN_NATS_PASSWORD",
        ),
        token=resolve_secret(
            file=pick("nats_token_file"), value=_env("DYN_NATS_TOKEN"), what="NATS token",
            file_flag="--nats-token-file", env="DYN_NATS_TOKEN",
        ),
        nkey_seed_file=pick("nats_nkey_seed_file"),
        creds_file=pick("nats_creds_file"),
        tls_handshake_first=_switch(ns, "nats_tls_handshake_first"),
    )
    _check_nats(nats)
    return SecuritySettings(request_plane, etcd, nats)


def _check_nats(nats: NatsSecurity) -> None:
    kinds = [
        name
        for name, given in (
            ("user/password", nats.user or nats.password),
            ("token", nats.token),
            ("NKey seed", nats.nkey_seed_file),
            ("credentials file", nats.creds_file),
        )
        if given
    ]
    if len(kinds) > 1:
        raise ConfigError(f"NATS: give one kind of credentials, not {' and '.join(kinds)}")
    if bool(nats.user) != bool(nats.password):
        raise ConfigError("NATS user auth needs both --nats-user and a password (--nats-password-file / DYN_NATS_PASSWORD)")
    for what, path in (("NKey seed", nats.nkey_seed_file), ("credentials", nats.creds_file)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"NATS: {what} file {path!r} does not exist")


def security_env(ns: argparse.Namespace) -> dict[str, str]:
    """The security flags given on this command line as ``DYN_*`` variables, for child processes
    (``dynamod up``): they are paths, names and switches, never secret values."""
    env = {_FLAGS[dest][1]: str(getattr(ns, dest)) for dest in _FLAGS if getattr(ns, dest, None)}
    env.update({_SWITCHES[dest][1]: "1" for dest in _SWITCHES if getattr(ns, dest, None)})
    return env
