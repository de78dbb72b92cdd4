"""API keys on the OpenAI port: who may call the frontend's HTTP routes.

Keys come from a file (``--api-key-file`` / ``DYN_API_KEY_FILE``, one key per line, ``#`` comments
and blank lines ignored) and/or the environment (``DYN_API_KEY``, comma-separated), never from a
flag value: ``ps`` shows every process's arguments to every user (``shared/security/secrets``).
Clients send a key the way OpenAI's do, ``Authorization: Bearer KEY``, or the way Anthropic's do,
``x-api-key: KEY``: either is accepted on every route (``presented_key``).

The comparison takes the same time whatever was presented: the presented key and every accepted
key are hashed to SHA-256 first (equal lengths) and compared with ``hmac.compare_digest`` against
*all* keys, without stopping at a match, so neither the timing of a refusal nor of an acceptance
says which key or how much of one was right.

The file is read again when it changes (checked at most once a second, by its mtime and size, on
the request path: one ``stat``) and on SIGHUP, so keys can be added and revoked without a restart.
A file that becomes unreadable or empty keeps the keys already loaded (logged): a half-written
file must not open the door or lock everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Iterable

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.api_keys import MIN_API_KEY_CHARS, parse_keys
from dynamod.shared.security.secrets import shown_path

logger = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The keys this frontend accepts (see the module docstring). ``repr`` never shows them."""

    __slots__ = ("_digests", "_ids", "_file", "_env_keys", "_stamp", "_next_check")

    def __init__(self, keys: Iterable[str] = (), *, file: str | None = None) -> None:
        self._env_keys = [k.strip() for k in keys if k.strip()]
        for key in self._env_keys:
            if len(key) < MIN_API_KEY_CHARS:
                raise ConfigError(f"an API key in DYN_API_KEY has {len(key)} characters; at least {MIN_API_KEY_CHARS} are needed")
        self._file = file
        self._stamp: tuple[int, int] | None = None
        self._next_check = 0.0
        self._digests: list[bytes] = []
        self._ids: list[str] = []
        file_keys = self._read_file() if file else []
        if file and not file_keys:
            raise ConfigError(f"API keys file {file!r} holds no key")
        self._install([*self._env_keys, *file_keys])

    @classmethod
    def from_sources(cls, file: str | None, env_value: str | None) -> ApiKeys | None:
        """The keys from ``--api-key-file`` and ``DYN_API_KEY``; None when neither names any (open)."""
        env_keys = [k for k in (env_value or "").split(",") if k.strip()]
        if not file and not env_keys:
            return None
        return cls(env_keys, file=file or None)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys, file={self._file!r})"

    def _install(self, keys: list[str]) -> None:
        digests = [_digest(k.encode()) for k in dict.fromkeys(keys)]
        # A short, stable name per key for rate-limit buckets and logs: never the key itself.
        self._ids = ["key-" + d.hex()[:12] for d in digests]
        self._digests = digests

    def _read_file(self) -> list[str]:
        assert self._file is not None
        try:
            with open(self._file, encoding="utf-8") as f:
                st = os.fstat(f.fileno())
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read API keys file {shown_path(self._file)}: {getattr(exc, 'strerror', None) or type(exc).__name__}") from exc
        self._stamp = (st.st_mtime_ns, st.st_size)
        return parse_keys(text, repr(self._file))

    def reload(self) -> bool:
        """Reads the keys file again (SIGHUP, or it changed). True when the new keys are in use;
        False (and the old keys kept) when the file cannot be read, is empty or holds a bad key."""
        if self._file is None:
            return False
        try:
            file_keys = self._read_file()
        except ConfigError as exc:
            logger.warning("api keys reload failed file=%s error=%s action=kept_previous_keys", self._file, exc)
            return False
        if not file_keys:
            logger.warning("api keys reload found no key file=%s action=kept_previous_keys", self._file)
            return False
        self._install([*self._env_keys, *file_keys])
        logger.info("api keys reloaded file=%s keys=%d", self._file, len(self._digests))
        return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + RELOAD_CHECK_S
        try:
            st = os.stat(self._file)  # type: ignore[arg-type]
        except OSError:
            return  # gone for a moment (an editor's rename): keep the keys until it is back
        if (st.st_mtime_ns, st.st_size) != self._stamp:
            self.reload()

    def identify(self, presented: bytes | None) -> str | None:
        """The accepted key's id (``key-<hash prefix>``) for ``presented``, or None."""
        if self._file is not None:
            self._maybe_reload()
        if not presented:
            return None
        candidate = _digest(presented)
        found = -1
        for index, digest in enumerate(self._digests):
            if hmac.compare_digest(candidate, digest):  # no early exit: every key is compared
                found = index
        return self._ids[found] if found >= 0 else None


def bearer_key(authorization: bytes | None) -> bytes | None:
    """The key of an ``Authorization: Bearer KEY`` header value (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    key = key.strip()
    return key or None


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request presents: ``Authorization: Bearer KEY`` (OpenAI's clients), else
    ``x-api-key: KEY`` (Anthropic's). Both name the same keys; an Authorization header that is not
    Bearer falls through to ``x-api-key``."""
    api_key: bytes | None = None
    for name, value in headers:
        if name == b"authorization":
            key = bearer_key(value)
            if key is not None:
                return key
        elif name == b"x-api-key":
            api_key = value.strip() or None
    return api_key
