"""Makes a cluster's certificates and token: one CA, one certificate per host, a client certificate
for operators, and the cluster token. For the deploy configs and the tests (which use exactly what
an operator would), run as::

    python -m dynamod.shared.security.certs --out /etc/dynamod/tls --host node1 --host 10.0.0.11 \\
        --host node2 --host 10.0.0.12 --client dynamoctl

Every ``--host`` (DNS name or IP address) goes into one server+client certificate named by
``--node`` (default ``node``): run the command once per node with its own ``--node`` and
``--host`` values, or once for a small cluster whose hosts all share one certificate. The CA key
stays in ``--out``: keep it offline once the certificates are out. An existing CA in ``--out`` is
reused, so adding a node later issues its certificate under the same CA; an existing token is kept.
Files are written 0600 (keys, token) and 0644 (certificates).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 825
CA_NAME = "ca"
TOKEN_FILE = "cluster.token"


@dataclass(frozen=True, slots=True)
class Issued:
    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dynamod"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def load_or_make_ca(out: Path, days: int = DEFAULT_DAYS) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in ``out`` (``ca.pem``, ``ca-key.pem``), made first if absent."""
    cert_path, key_path = out / f"{CA_NAME}.pem", out / f"{CA_NAME}-key.pem"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey), "the CA key must be an EC key made by this tool"
        return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("dynamod cluster CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue(
    out: Path,
    file_stem: str,
    common_name: str,
    *,
    hosts: list[str],
    server: bool,
    days: int = DEFAULT_DAYS,
) -> Issued:
    """A certificate signed by the CA in ``out`` for ``hosts`` (DNS names and IP addresses), usable
    by a client always and by a server when ``server``; written as ``<stem>.pem``/``<stem>-key.pem``.
    The common name doubles as the etcd user name when etcd authenticates by client certificate."""
    ca_cert, ca_key = load_or_make_ca(out, days)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=True, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    issued = Issued(out / f"{file_stem}.pem", out / f"{file_stem}-key.pem")
    _write(issued.key_file, _key_pem(key), 0o600)
    _write(issued.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return issued


def write_token(out: Path, *, overwrite: bool = False) -> Path:
    """A fresh cluster token (256 random bits, URL-safe) in ``out/cluster.token``, mode 0600; an
    existing token is kept unless ``overwrite`` (rotating it means restarting every member)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / TOKEN_FILE
    if path.exists() and not overwrite:
        return path
    _write(path, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m dynamod.shared.security.certs",
        description="Make a dynamod cluster's CA, host and client certificates and its cluster token.",
    )
    p.add_argument("--out", required=True, help="directory for the files (created; an existing CA is reused)")
    p.add_argument("--host", action="append", default=[],
                   help="DNS name or IP address the host certificate must cover (repeatable)")
    p.add_argument("--node", default="node",
                   help="file name of the host certificate: <node>.pem / <node>-key.pem [default node]")
    p.add_argument("--client", action="append", default=[],
                   help="also issue a client-only certificate with this name (repeatable), e.g. dynamoctl")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity in days [default {DEFAULT_DAYS}]")
    p.add_argument("--token-only", action="store_true", help="only write the cluster token")
    p.add_argument("--rotate-token", action="store_true", help="replace an existing cluster token")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        written = [write_token(out, overwrite=args.rotate_token)]
        if not args.token_only:
            if not args.host and not args.client:
                print("certs: error: give --host NAME (and/or --client NAME), or --token-only", file=sys.stderr)
                return 2
            if args.days < 1:
                print("certs: error: --days must be 1 or more", file=sys.stderr)
                return 2
            load_or_make_ca(out, args.days)
            written.append(out / f"{CA_NAME}.pem")
            if args.host:
                issued = issue(out, args.node, args.node, hosts=args.host, server=True, days=args.days)
                written += [issued.cert_file, issued.key_file]
            for name in args.client:
                issued = issue(out, name, name, hosts=[], server=False, days=args.days)
                written += [issued.cert_file, issued.key_file]
    except (OSError, ValueError, AssertionError) as exc:
        print(f"certs: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
