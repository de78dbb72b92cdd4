"""The argument parser of every dynamod command line (roles, ``dynamod up``, ``dynamoctl``, the console).

Two differences from ``argparse.ArgumentParser``, both about flags that hold secrets or paths to them:

- Abbreviations are off (``allow_abbrev=False``). With them on, ``--api-key sk-...`` is taken as
  ``--api-key-file``, and the key is then read as a path and printed in the error that the file
  cannot be read. Off, a flag is matched only by its full name, so a typo is a plain "unrecognized
  arguments" error. Subparsers are built with this class too (argparse's default), so
  ``dynamoctl lora load`` matches only full names as well.
- "unrecognized arguments" lists the unknown *flags* and counts the other words instead of echoing
  them: the word after an unknown flag is its value, and that value may be a key. An error message
  ends up in logs and, under ``dynamod up``, on the supervisor's terminal.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def unrecognized_message(extras: Sequence[str]) -> str:
    """``unrecognized arguments: --api-key (and 1 value, not shown)``: flag names only (the part
    before ``=`` of ``--flag=value``), since a value may be a secret."""
    flags = [word.split("=", 1)[0] for word in extras if word.startswith("-") and len(word) > 1]
    hidden = sum(1 for word in extras if not (word.startswith("-") and len(word) > 1) or "=" in word)
    values = f"{hidden} value{'s' if hidden > 1 else ''}, not shown"
    if not flags:
        return f"unrecognized arguments: {values}"
    return f"unrecognized arguments: {' '.join(flags)}" + (f" (and {values})" if hidden else "")


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations and without echoing unknown values (see
    the module docstring). Drop-in: every other argument and behaviour is argparse's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized_message(extras))
        return parsed
