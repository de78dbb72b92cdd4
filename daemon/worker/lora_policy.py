"""Which LoRA adapters a worker may load: names that are safe to print and route by, and sources
that lie inside the directories the operator allowed.

A ``load_lora`` arrives over the request plane (``dynamoctl``, the console, a script holding the
cluster token) and its source becomes a servable model that is re-applied from the operator's
intent on every restart. Left unchecked, ``/etc``, ``/proc/self/environ``, ``root/../outside`` or
a symlink out of the adapter directory would all be "loaded". So every source is checked here,
whatever the engine (the mocker included), before the engine sees it:

- a local path (or ``file://`` URI) is resolved with symlinks followed (``realpath``); the result
  must lie inside one of the ``--lora-root`` directories (themselves resolved) and be a PEFT adapter
  directory (an ``adapter_config.json`` regular file, also inside the root). The *resolved* path is
  what the engine loads and what the intent records, so a symlink swapped after the check does not
  redirect a restart.
- a remote URI (``hf://``, ``s3://``, ...) only when its scheme was allowed with
  ``--lora-remote-scheme``; the engine may still refuse it (the real engines load local
  directories only).
- without any ``--lora-root`` a worker loads no adapter at all: the safe default for a process
  that anyone holding the cluster token can drive.

Names (``lora_name``) become model names, discovery key segments and console lines: they are
limited to ``LORA_NAME_PATTERN`` (no ``/``, no spaces, no control or escape characters).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dynamod.shared.errors import ConfigError, InvalidRequestError

ADAPTER_CONFIG = "adapter_config.json"
LORA_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}"
_NAME_RE = re.compile(LORA_NAME_PATTERN)
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_lora_name(name: object) -> str:
    """``name`` when it is a valid adapter name, else ``InvalidRequestError`` (one line, no echo of
    control characters: the offending name is shown with ``repr``-style escapes)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        shown = ascii(name)[:80]
        raise InvalidRequestError(
            f"lora_name {shown} is not valid: 1-128 characters, letters, digits and . _ : + @ -, "
            "starting with a letter or digit",
            param="lora_name",
        )
    return name


@dataclass(frozen=True, slots=True)
class LoraSourcePolicy:
    """The roots and remote schemes a worker accepts adapter sources from (module docstring)."""

    roots: tuple[Path, ...] = ()
    remote_schemes: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def create(cls, roots: list[str] | tuple[str, ...], remote_schemes: list[str] | tuple[str, ...] = ()) -> LoraSourcePolicy:
        """Resolves and checks the roots now: a missing root is a ConfigError at start-up."""
        resolved: list[Path] = []
        for raw in roots:
            if not raw:
                continue
            path = Path(os.path.realpath(Path(raw).expanduser()))
            if not path.is_dir():
                raise ConfigError(f"--lora-root {raw!r} is not a directory")
            if path == Path(path.anchor):
                raise ConfigError(f"--lora-root {raw!r} is the file system root; name the adapters' directory")
            resolved.append(path)
        schemes = frozenset(s.strip().lower().removesuffix("://") for s in remote_schemes if s.strip())
        if "file" in schemes:
            raise ConfigError("--lora-remote-scheme file: local sources are governed by --lora-root")
        return cls(tuple(resolved), schemes)

    @property
    def describe(self) -> str:
        roots = ",".join(str(r) for r in self.roots) or "none"
        return f"roots={roots} remote={','.join(sorted(self.remote_schemes)) or 'none'}"

    def check(self, source: object) -> str:
        """The source to hand the engine (a resolved local directory, or an allowed remote URI),
        or ``InvalidRequestError`` saying in one line why not."""
        if not isinstance(source, str) or not source or "\x00" in source:
            raise InvalidRequestError("LoRA source must be a non-empty path or URI", param="source")
        shown = ascii(source)[:200]
        path = source[len("file://"):] if source.startswith("file://") else source
        match = _SCHEME_RE.match(path)
        if match is not None:
            scheme = match.group(1).lower()
            if scheme not in self.remote_schemes:
                allowed = ", ".join(sorted(self.remote_schemes)) or "none"
                raise InvalidRequestError(
                    f"LoRA source {shown}: remote {scheme}:// sources are not allowed on this worker "
                    f"(allowed: {allowed}; see --lora-remote-scheme)",
                    param="source",
                )
            return source
        if not self.roots:
            raise InvalidRequestError(
                "this worker loads no LoRA adapters: start it with --lora-root DIR (env DYN_LORA_ROOT) naming the "
                "directory that holds them",
                param="source",
            )
        real = Path(os.path.realpath(Path(path).expanduser()))
        root = next((r for r in self.roots if real == r or real.is_relative_to(r)), None)
        if root is None:
            raise InvalidRequestError(
                f"LoRA source {shown} resolves to {ascii(str(real))[:200]}, which is not inside an adapter directory "
                f"of --lora-root ({', '.join(str(r) for r in self.roots)})",
                param="source",
            )
        config = real / ADAPTER_CONFIG
        config_real = Path(os.path.realpath(config))
        if not config.is_file() or not config_real.is_relative_to(root):
            raise InvalidRequestError(
                f"LoRA source {shown} is not a PEFT adapter directory (no {ADAPTER_CONFIG} inside the root)",
                param="source",
            )
        return str(real)


def add_lora_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--lora-root", action="append", metavar="DIR",
        help="directory LoRA adapter sources must lie in (symlinks resolved); repeatable; without one the worker "
             f"loads no adapter [env DYN_LORA_ROOT, '{os.pathsep}'-separated; default none]",
    )
    parser.add_argument(
        "--lora-remote-scheme", action="append", metavar="SCHEME",
        help="a remote LoRA source scheme to accept (e.g. hf, s3); repeatable; the engine must support it "
             "[env DYN_LORA_REMOTE_SCHEMES, comma-separated; default none]",
    )


def lora_policy_from_args(ns: argparse.Namespace) -> LoraSourcePolicy:
    """Flags, then ``DYN_LORA_ROOT`` / ``DYN_LORA_REMOTE_SCHEMES``."""
    roots = getattr(ns, "lora_root", None) or [r for r in os.environ.get("DYN_LORA_ROOT", "").split(os.pathsep) if r]
    schemes = getattr(ns, "lora_remote_scheme", None) or [
        s for s in os.environ.get("DYN_LORA_REMOTE_SCHEMES", "").split(",") if s.strip()
    ]
    return LoraSourcePolicy.create(roots, schemes)
