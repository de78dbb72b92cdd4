"""Reading and rewriting an engine's own command-line tokens, without importing the engine.

Every adapter whose engine takes a command line (vLLM's ``--vllm-args``, SGLang's
``--sglang-args``) passes it through unparsed; these helpers find, read and drop single flags so
the adapter can apply its rewrites before the engine's own parser sees the tokens.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Any

from dynamod.shared.errors import ConfigError

KV_EVENTS_FLAG = "--kv-events-config"


def engine_tokens(text: str | None, passthrough: Sequence[str] | None = None) -> list[str]:
    """The engine's flags: ``--<engine>-args`` (shell-quoted) plus pass-through tokens."""
    try:
        tokens = shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"cannot split engine arguments {text!r}: {exc}") from None
    return tokens + list(passthrough or [])


def _matches(token: str, names: Sequence[str]) -> str | None:
    for name in names:
        if token == name:
            return name
        if token.startswith(name + "="):
            return name
    return None


def flag_value(tokens: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` among ``tokens``."""
    value = None
    for i, token in enumerate(tokens):
        name = _matches(token, names)
        if name is None:
            continue
        if token == name:
            value = tokens[i + 1] if i + 1 < len(tokens) else None
        else:
            value = token[len(name) + 1 :]
    return value


def has_flag(tokens: Sequence[str], *names: str) -> bool:
    return any(_matches(t, names) for t in tokens)


def without_flag(tokens: Sequence[str], name: str, *, takes_value: bool = True) -> list[str]:
    out: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token == name:
            skip = takes_value
            continue
        if token.startswith(name + "="):
            continue
        out.append(token)
    return out


def int_flag(tokens: Sequence[str], *names: str) -> int | None:
    value = flag_value(tokens, *names)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{names[0]} must be an integer, got {value!r}") from None


def json_object_flag(tokens: Sequence[str], name: str) -> dict[str, Any] | None:
    """The JSON object the operator gave as ``name`` (engines take their configs this way), if any."""
    raw = flag_value(tokens, name)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object")
    return value


def user_kv_events_config(tokens: Sequence[str]) -> dict[str, Any] | None:
    """The operator's ``--kv-events-config`` JSON, if any."""
    return json_object_flag(tokens, KV_EVENTS_FLAG)
