"""Secrets (the cluster token, etcd and NATS passwords) read from files or the environment.

Never from a command-line flag: ``ps`` shows every process's arguments to every user, while a file
(mode 0600) or the environment (``/proc/PID/environ``, owner only) do not. A secret file that
others may read is used, with one warning, because refusing would take a cluster down over a
``chmod``.
"""

from __future__ import annotations

import logging
import os
import stat

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)


def shown_path(path: str) -> str:
    """``path`` quoted for an error message, unless it does not look like a path: a key typed
    where a file name was expected (``--api-key-file sk-...``) must not be printed back, into a
    log or onto a terminal someone else reads. A path has a ``/``, or a name with an extension."""
    looks_like_path = "/" in path or path.startswith((".", "~")) or ("." in path and " " not in path)
    return repr(path) if looks_like_path and len(path) < 4096 else "(the value given, not shown: it may be a secret)"


def read_secret_file(path: str, what: str) -> str:
    """The file's content without surrounding whitespace (a trailing newline is not part of it)."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: cannot read {shown_path(path)}: {getattr(exc, 'strerror', None) or type(exc).__name__}") from exc
    if not value:
        raise ConfigError(f"{what}: {shown_path(path)} is empty")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("secret file readable by others path=%s what=%s hint=chmod_600", path, what)
    return value


def resolve_secret(*, file: str | None, value: str | None, what: str, file_flag: str, env: str) -> str | None:
    """One secret from a file or a value (the environment); both given is ambiguous, so refused."""
    if file and value:
        raise ConfigError(f"{what}: give either {file_flag} or {env}, not both")
    if file:
        return read_secret_file(file, what)
    return value.strip() if value and value.strip() else None
