"""How ``dynamod up`` reaches a child's HTTP port: in the scheme it serves, with the key it asks for.

The supervisor probes the frontend twice: ``/live`` to judge it alive (a child that stops answering
is killed and restarted) and ``/health`` to know when the cluster is ready. Both must speak what the
frontend serves, or a healthy frontend looks dead:

- HTTPS (``--http-tls-cert-file`` in ``--frontend-args`` or ``DYN_HTTP_TLS_CERT_FILE``): a plain
  HTTP probe of a TLS port fails every time, so the supervisor killed the frontend as hung every
  30 s, cutting every stream. The probe speaks TLS and trusts exactly the certificate the frontend
  serves (partial-chain verification, no host name check: the probe dials loopback, which a
  certificate rarely names), so the key it sends goes to that frontend and no other listener.
- API keys (``DYN_API_KEY`` or ``--api-key-file``): ``/live`` stays open, but ``/health`` shows an
  unauthenticated caller only its status, not the models and workers readiness is judged by, so
  ``up`` never printed its banner. The readiness poll presents the first key, read when it polls
  (a keys file may change).

The frontend resolves these settings as flag, then environment; so does ``frontend_target``.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynamod.daemon.supervisor.passthrough import flag_value
from dynamod.shared.errors import ConfigError
from dynamod.shared.security.api_keys import parse_keys

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0


def pinned_context(cert_file: str) -> ssl.SSLContext:
    """A client context that accepts the server presenting ``cert_file``'s certificate (or one
    its chain in that file vouches for), whatever name it carries."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf itself is the trust anchor
    ctx.load_verify_locations(cafile=cert_file)
    return ctx


@dataclass(frozen=True)
class HttpTarget:
    """A child's HTTP port as it serves it: ``base_url`` (http or https), the TLS context the
    probe uses, and where the API key the port asks for comes from."""

    base_url: str
    ssl_context: ssl.SSLContext | None = None
    api_key_env: str | None = None  # DYN_API_KEY's value (comma-separated keys)
    api_key_file: str | None = None

    def api_key(self) -> str | None:
        """The key the probe presents: the first of ``DYN_API_KEY``, else the keys file's first;
        None when the port is open or the file cannot be read now (the probe then sees status only)."""
        for key in (self.api_key_env or "").split(","):
            if key.strip():
                return key.strip()
        if not self.api_key_file:
            return None
        try:
            with open(self.api_key_file, encoding="utf-8") as f:
                keys = parse_keys(f.read(), "the API keys file")
        except (OSError, UnicodeDecodeError, ConfigError):
            return None
        return keys[0] if keys else None

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str, *, authenticated: bool = False) -> tuple[int, bytes] | None:
        """(status, body) of ``GET path``; None when nothing answered."""
        request = urllib.request.Request(self.url(path))
        key = self.api_key() if authenticated else None
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S, context=self.ssl_context) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def live(self, path: str = "/live") -> bool:
        answer = self.get(path)
        return answer is not None and answer[0] == 200

    def health(self) -> dict | None:
        """The ``/health`` body (with the key, so it has the models), or None."""
        answer = self.get("/health", authenticated=True)
        if answer is None:
            return None
        try:
            body = json.loads(answer[1])
        except ValueError:
            return None
        return body if isinstance(body, dict) else None


def probe_host(host: str) -> str:
    """The address to dial for a listener bound to ``host`` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def frontend_target(host: str, port: int, frontend_words: Sequence[str], env: Mapping[str, str] | None = None) -> HttpTarget:
    """The frontend's port as ``--frontend-args`` (then the environment) make it serve."""
    env = os.environ if env is None else env
    cert = flag_value(frontend_words, "--http-tls-cert-file") or env.get("DYN_HTTP_TLS_CERT_FILE") or None
    keys_file = flag_value(frontend_words, "--api-key-file") or env.get("DYN_API_KEY_FILE") or None
    context: ssl.SSLContext | None = None
    if cert:
        try:
            context = pinned_context(cert)
        except (OSError, ssl.SSLError) as exc:
            # The frontend cannot serve it either and will say why in its own log; the probe
            # still speaks TLS so a frontend that does start is not taken for a hung one.
            logger.warning("cannot pin the frontend certificate file=%s error=%s action=probe_unverified", cert, exc)
            # It sends no API key to a port it cannot verify.
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return HttpTarget(f"https://{_url_host(host)}:{port}", context)
    scheme = "https" if cert else "http"
    return HttpTarget(f"{scheme}://{_url_host(host)}:{port}", context, env.get("DYN_API_KEY") or None, keys_file)


def _url_host(host: str) -> str:
    host = probe_host(host)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
