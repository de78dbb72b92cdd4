"""The OpenAI port's API keys as written in a keys file: one per line, ``#`` comments, a minimum
length. Here rather than in the frontend because ``dynamod up`` reads the same file for its
readiness probe (daemon/supervisor/probe.py), and a role must not import another role."""

from __future__ import annotations

from dynamod.shared.errors import ConfigError

MIN_API_KEY_CHARS = 16
"""Shorter keys are refused at start-up, as the cluster token is: a guessable key is no lock."""


def parse_keys(text: str, where: str) -> list[str]:
    """The keys of a keys file's text; ConfigError naming ``where`` for one too short."""
    keys = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) < MIN_API_KEY_CHARS:
            raise ConfigError(
                f"API key on line {number} of {where} has {len(line)} characters; at least {MIN_API_KEY_CHARS} are "
                "needed (make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        keys.append(line)
    return keys
