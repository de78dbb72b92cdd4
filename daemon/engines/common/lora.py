"""Where a LoRA adapter to load lives: every engine adapter loads local PEFT directories only."""

from __future__ import annotations

from pathlib import Path

from dynamod.shared.errors import InvalidRequestError


def local_adapter_dir(source: str) -> str:
    """The absolute adapter directory for ``source`` (a path or ``file://`` URI); refuses remote
    sources and directories without ``adapter_config.json`` before the engine is asked."""
    path = source[len("file://"):] if source.startswith("file://") else source
    if "://" in path:
        raise InvalidRequestError(
            f"LoRA source {source!r}: only local adapter directories (or file:// URIs) can be loaded", param="source"
        )
    p = Path(path).expanduser()
    if not (p / "adapter_config.json").is_file():
        raise InvalidRequestError(f"LoRA source {source!r} is not a PEFT adapter directory (no adapter_config.json)", param="source")
    return str(p.resolve())
