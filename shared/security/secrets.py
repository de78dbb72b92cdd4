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


def read_secret_file(path: str, what: str) -> str:
    """The file's content without surrounding whitespace (a trailing newline is not part of it)."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc}") from exc
    if not value:
        raise ConfigError(f"{what}: {path!r} is empty")
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
