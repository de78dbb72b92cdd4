"""What the encode pool needs to know of a vision-language model: its embeddings' width."""

from __future__ import annotations

import json
import os

from dynamod.shared.errors import ConfigError


def model_hidden_size(path: os.PathLike[str] | str) -> int:
    """The language model's hidden size (what the vision tower projects each image token to),
    from the model's config.json; ``ConfigError`` when it is not a vision-language model."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model's config.json in {path}: {exc}") from None
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    if "vision_config" not in config or not isinstance(hidden, int) or hidden <= 0:
        raise ConfigError(f"the model in {path} is not a vision-language model (no vision_config and hidden_size)")
    return hidden


def vision_hidden_size(path: os.PathLike[str] | str) -> int | None:
    """``model_hidden_size``, or None for a model without a vision tower."""
    try:
        return model_hidden_size(path)
    except ConfigError:
        return None
