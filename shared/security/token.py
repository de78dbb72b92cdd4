"""The cluster token: a shared secret every member presents before the request plane serves it.

Compared in constant time (``hmac.compare_digest``), so the time a refusal takes says nothing
about how much of a guess was right. A token shorter than ``MIN_TOKEN_CHARS`` is refused at
start-up: a guessable token is a door left open with a sign saying it is locked.
"""

from __future__ import annotations

import hmac
import logging
import time

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class ClusterToken:
    """The token this process presents and expects. ``repr`` never shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        value = value.strip()
        if len(value) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"the cluster token must be at least {MIN_TOKEN_CHARS} characters (got {len(value)}); "
                "make one with: python -m dynamod.shared.security.certs --token-only --out DIR"
            )
        self._value = value.encode()

    @property
    def value(self) -> str:
        return self._value.decode()

    def matches(self, presented: str | bytes | None) -> bool:
        if presented is None:
            return False
        candidate = presented.encode() if isinstance(presented, str) else presented
        return hmac.compare_digest(candidate, self._value)

    def __repr__(self) -> str:
        return "ClusterToken(***)"


REASON_MISSING_TOKEN = "missing_token"
REASON_BAD_TOKEN = "bad_token"
REASON_TLS_HANDSHAKE = "tls_handshake"
REASON_HANDSHAKE_TIMEOUT = "handshake_timeout"


class RejectionLog:
    """Logs refused peers once per (peer host, reason) per ``interval_s``, with how many were
    suppressed meanwhile: a scanner hammering the port must not flood the log, yet the first
    refusal of a misconfigured member is always visible."""

    def __init__(self, what: str, interval_s: float = 60.0, max_peers: int = 1024) -> None:
        self._what = what
        self._interval_s = interval_s
        self._max_peers = max_peers
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def rejected(self, peer: str, reason: str, detail: str = "") -> None:
        host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 or peer.startswith("[") else peer
        key = (host, reason)
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self._interval_s:
            self._last[key] = (seen[0], seen[1] + 1)
            return
        suppressed = seen[1] if seen is not None else 0
        if len(self._last) >= self._max_peers:
            self._last.clear()  # bounded memory under a scan from many addresses
        self._last[key] = (now, 0)
        logger.warning(
            "%s.unauthenticated peer=%s reason=%s%s suppressed_since_last=%d action=close",
            self._what,
            peer,
            reason,
            f" detail={detail!r}" if detail else "",
            suppressed,
        )
