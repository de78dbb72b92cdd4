"""Reads the JSON files of an HF-style model directory.

Model directories come from many exporters, so every field read here tolerates the variants seen in
practice: a token written as a string or as a serialized ``AddedToken`` dict, ``eos_token_id`` as an
int or a list, the context length under several names, and the chat template inline in
``tokenizer_config.json`` (a string or a list of named templates) or in ``chat_template.jinja``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Names under which config.json files state the context length, most specific first.
_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
)
# tokenizer_config.json uses a huge sentinel (int(1e30)) for "unknown".
_MAX_SANE_CONTEXT = 10_000_000


def read_json(path: Path) -> dict[str, Any]:
    """Returns the JSON object in ``path``, or an empty dict when the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def token_content(value: object) -> str | None:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def as_id_list(value: object) -> list[int]:
    """``eos_token_id`` is an int in older configs and a list in newer ones."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def added_token_ids(tokenizer_json: dict[str, Any]) -> dict[str, int]:
    """Content -> id of the added tokens listed in a tokenizer.json."""
    out: dict[str, int] = {}
    for entry in tokenizer_json.get("added_tokens") or []:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("content"), str)
            and isinstance(entry.get("id"), int)
        ):
            out[entry["content"]] = entry["id"]
    return out


def eos_token_ids(model_dir: Path, token_ids: Callable[[], dict[str, int]]) -> list[int]:
    """The ids that end generation, in order of authority.

    generation_config.json is what HF's ``generate`` uses (it lists every end token of instruct
    models, e.g. Llama 3's ``<|eot_id|>`` and ``<|eom_id|>``); config.json comes next; the
    tokenizer's ``eos_token`` string is the last resort. ``token_ids`` returns the map of special
    token strings to ids (from tokenizer.json) for that last step; it is only called if needed.
    """
    ids = as_id_list(read_json(model_dir / GENERATION_CONFIG_FILE).get("eos_token_id"))
    if not ids:
        ids = as_id_list(read_json(model_dir / CONFIG_FILE).get("eos_token_id"))
    if not ids:
        eos = token_content(read_json(model_dir / TOKENIZER_CONFIG_FILE).get("eos_token"))
        known = token_ids() if eos is not None else {}
        if eos in known:
            ids = [known[eos]]
    return list(dict.fromkeys(ids))


def context_length(config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int | None:
    """The model's context window from config.json, else tokenizer_config's ``model_max_length``."""
    text_config = config.get("text_config")
    for source in (config, text_config if isinstance(text_config, dict) else {}):
        for key in _CONTEXT_LENGTH_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    value = tokenizer_config.get("model_max_length")
    if isinstance(value, int | float) and 0 < value < _MAX_SANE_CONTEXT:
        return int(value)
    return None


def chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The model's default chat template, or None when it has none.

    ``chat_template.jinja`` is where newer HF exports save it and wins when present; otherwise the
    ``chat_template`` field, which is a string or a list of ``{"name", "template"}`` from which the
    one named ``default`` is taken.
    """
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            entry.get("name"): entry.get("template")
            for entry in value
            if isinstance(entry, dict) and isinstance(entry.get("template"), str)
        }
        if "default" in named:
            return named["default"]
        if named:
            name, template = next(iter(named.items()))
            logger.info("chat_template_pick dir=%s name=%s reason=no_default", model_dir, name)
            return template
    return None
