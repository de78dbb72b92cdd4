"""Model resolution: the shipped tiny model, local HF-style directories, and refusals."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR, LocalModel, resolve_model
from dynamod.shared.errors import ConfigError, NotFoundError

REPO_ROOT = Path(__file__).resolve().parents[3]


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_tokenizer", REPO_ROOT / "scripts" / "make_tiny_tokenizer.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_dir(tmp_path: Path, name: str = "my-model", **files: object) -> Path:
    """A model directory with the tiny tokenizer and the given JSON files (None: leave out)."""
    path = tmp_path / name
    path.mkdir()
    shutil.copy(TINY_MODEL_DIR / "tokenizer.json", path / "tokenizer.json")
    for filename, data in files.items():
        if data is not None:
            (path / f"{filename}.json").write_text(json.dumps(data), encoding="utf-8")
    return path


def test_tiny_model_resolves_to_shipped_assets() -> None:
    model = resolve_model("tiny")
    assert isinstance(model, LocalModel)
    assert model.name == "tiny"
    assert model.path == TINY_MODEL_DIR.resolve()
    assert model.tokenizer_path.is_file()
    assert model.context_length == 8192
    assert model.vocab_size == 4096
    assert model.bos_token == "<|begin_of_text|>"
    assert model.eos_token == "<|eot_id|>"
    assert model.chat_template is not None and "add_generation_prompt" in model.chat_template

    tokenizer = Tokenizer.from_dir(model.path)
    assert tokenizer.vocab_size == model.vocab_size
    assert tokenizer.token_to_id("<|eot_id|>") in model.eos_token_ids
    assert tokenizer.token_to_id("<|end_of_text|>") in model.eos_token_ids
    assert tokenizer.eos_token_ids == model.eos_token_ids


def test_tiny_assets_are_small_and_match_their_script() -> None:
    total = sum(p.stat().st_size for p in TINY_MODEL_DIR.iterdir())
    assert total < 1_000_000
    script = _load_script()
    tokenizer_config = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert tokenizer_config["chat_template"] == script.CHAT_TEMPLATE
    assert config["vocab_size"] == script.VOCAB_SIZE
    assert config["max_position_embeddings"] == script.CONTEXT_LENGTH
    assert config["model_type"] == "llama"
    tokenizer = Tokenizer.from_dir(TINY_MODEL_DIR)
    for token in script.SPECIAL_TOKENS:
        assert tokenizer.token_to_id(token) in tokenizer.special_token_ids


def test_directory_resolves_with_its_basename_and_generation_config_eos(tmp_path: Path) -> None:
    path = _model_dir(
        tmp_path,
        config={"max_position_embeddings": 2048, "vocab_size": 4096, "eos_token_id": 4089},
        generation_config={"eos_token_id": [4092, 4089]},
        tokenizer_config={
            "bos_token": {"content": "<|begin_of_text|>", "special": True},
            "eos_token": "<|eot_id|>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ messages[0]['content'] }}"},
            ],
        },
    )
    model = resolve_model(str(path))
    assert model.name == "my-model"
    assert model.path == path.resolve()
    assert model.context_length == 2048
    assert model.eos_token_ids == [4092, 4089]
    assert model.bos_token == "<|begin_of_text|>"
    assert model.chat_template == "{{ messages[0]['content'] }}"


def test_directory_eos_falls_back_to_tokenizer_config_token(tmp_path: Path) -> None:
    path = _model_dir(
        tmp_path,
        config={"n_positions": 1024},
        tokenizer_config={"eos_token": "<|eot_id|>"},
    )
    (path / "chat_template.jinja").write_text("{{ bos_token }}jinja-file", encoding="utf-8")
    model = resolve_model(str(path))
    tokenizer = Tokenizer.from_dir(path)
    assert model.eos_token_ids == [tokenizer.token_to_id("<|eot_id|>")]
    assert tokenizer.eos_token_ids == model.eos_token_ids
    assert model.vocab_size == 4096  # from tokenizer.json when config.json has none
    assert model.context_length == 1024
    assert model.chat_template == "{{ bos_token }}jinja-file"


def test_hub_id_is_refused_without_contacting_anything() -> None:
    with pytest.raises(NotFoundError) as info:
        resolve_model("meta-llama/Llama-3.1-8B-Instruct")
    message = str(info.value)
    assert "never contacts a model hub" in message
    assert "directory" in message and "'tiny'" in message


def test_directory_without_config_is_not_a_model(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, tokenizer_config={})
    with pytest.raises(NotFoundError, match="missing config.json"):
        resolve_model(str(path))


def test_file_path_is_refused(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, config={"max_position_embeddings": 16})
    with pytest.raises(NotFoundError, match="is a file"):
        resolve_model(str(path / "config.json"))


def test_directory_without_context_length_is_a_config_error(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, config={"vocab_size": 4096})
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        resolve_model(str(path))


def test_broken_json_is_a_config_error(tmp_path: Path) -> None:
    path = _model_dir(tmp_path)
    (path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_model(str(path))
