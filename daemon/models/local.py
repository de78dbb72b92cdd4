"""Turns a ``--model`` argument into a local model directory.

dynamod never contacts a model hub: a model is either the built-in ``tiny`` (shipped in
``daemon/assets/tiny``, for tests, the mocker and ``dynamod up``), its vision-language sibling
``tiny-vl`` (``daemon/assets/tiny-vl``, tiny_vl.py) or a directory on this machine in
the HF layout (``tokenizer.json`` + ``config.json`` [+ ``tokenizer_config.json``,
``generation_config.json``]). Everything the frontend and workers need from it is read once here
into a ``LocalModel``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from dynamod.shared.errors import ConfigError, NotFoundError

from . import hf_config
from .kv_layout import KvGeometry, kv_geometry
from .tiny_vl import TINY_VL_MODEL_DIR, TINY_VL_MODEL_NAME

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny"
TINY_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny"

_REQUIRED_FILES = (hf_config.TOKENIZER_FILE, hf_config.CONFIG_FILE)


@dataclass(frozen=True)
class LocalModel:
    """A model resolved to files on this machine.

    ``name`` is the name clients use in requests (``tiny`` or the directory's basename);
    ``tokenizer_path`` is the ``tokenizer.json`` file (its directory is ``path``); ``bos_token`` and
    ``eos_token`` are the token texts chat templates refer to.
    """

    name: str
    path: Path
    tokenizer_path: Path
    context_length: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = field(default=None, repr=False)
    kv_geometry: KvGeometry | None = None  # per-token KV shape (disaggregation); None if unknown


def resolve_model(name_or_path: str) -> LocalModel:
    """Returns the model that ``name_or_path`` names: ``tiny`` or a local model directory.

    Raises ``NotFoundError`` for anything else (a hub id such as ``meta-llama/Llama-3.1-8B``
    included) and ``ConfigError`` for a directory whose files cannot be understood.
    """
    if name_or_path == TINY_MODEL_NAME:
        return load_model_dir(TINY_MODEL_DIR, name=TINY_MODEL_NAME)
    if name_or_path == TINY_VL_MODEL_NAME:
        return load_model_dir(TINY_VL_MODEL_DIR, name=TINY_VL_MODEL_NAME)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return load_model_dir(path)
    if path.exists():
        raise NotFoundError(
            f"model {name_or_path!r} is a file, not a model directory: pass the directory that holds "
            f"{' and '.join(_REQUIRED_FILES)}"
        )
    raise NotFoundError(
        f"model {name_or_path!r} is neither a built-in model ({TINY_MODEL_NAME!r}, {TINY_VL_MODEL_NAME!r}) nor a local directory. "
        "dynamod never contacts a model hub: download the model on a machine that can (for example "
        "`huggingface-cli download <repo> --local-dir <dir>`), copy it here and pass that directory "
        f"path, or pass {TINY_MODEL_NAME!r} for the built-in test model"
    )


def load_model_dir(path: Path, *, name: str | None = None) -> LocalModel:
    """Reads an HF-style model directory into a ``LocalModel`` (served as ``name`` or its basename)."""
    path = path.resolve()
    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise NotFoundError(
            f"{path} is not a model directory: missing {', '.join(missing)} "
            f"(a model directory holds {' and '.join(_REQUIRED_FILES)}, as HF exports do)"
        )
    config = hf_config.read_json(path / hf_config.CONFIG_FILE)
    tokenizer_config = hf_config.read_json(path / hf_config.TOKENIZER_CONFIG_FILE)

    context_length = hf_config.context_length(config, tokenizer_config)
    if context_length is None:
        raise ConfigError(
            f"{path / hf_config.CONFIG_FILE} does not state the context length "
            "(max_position_embeddings); add it to config.json"
        )

    tokenizer_json: dict[str, object] | None = None

    def load_tokenizer_json() -> dict[str, object]:
        # Only read when a fallback needs it: a large model's tokenizer.json is several MB.
        nonlocal tokenizer_json
        if tokenizer_json is None:
            tokenizer_json = hf_config.read_json(path / hf_config.TOKENIZER_FILE)
        return tokenizer_json

    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        vocab_size = _tokenizer_vocab_size(load_tokenizer_json())

    eos_ids = hf_config.eos_token_ids(path, lambda: hf_config.added_token_ids(load_tokenizer_json()))
    if not eos_ids:
        logger.warning("model_no_eos path=%s effect=generation_stops_only_at_max_tokens", path)

    model = LocalModel(
        name=name or path.name,
        path=path,
        tokenizer_path=path / hf_config.TOKENIZER_FILE,
        context_length=context_length,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        bos_token=hf_config.token_content(tokenizer_config.get("bos_token")),
        eos_token=hf_config.token_content(tokenizer_config.get("eos_token")),
        chat_template=hf_config.chat_template(path, tokenizer_config),
        kv_geometry=kv_geometry(config),
    )
    logger.info(
        "model_resolved name=%s path=%s context_length=%d vocab_size=%d eos_token_ids=%s chat_template=%s",
        model.name,
        model.path,
        model.context_length,
        model.vocab_size,
        model.eos_token_ids,
        model.chat_template is not None,
    )
    return model


def _tokenizer_vocab_size(tokenizer_json: dict[str, object]) -> int:
    """Vocabulary size from tokenizer.json: the model's vocab plus added tokens beyond it."""
    model = tokenizer_json.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids: set[int] = set()
    if isinstance(vocab, dict):
        ids.update(v for v in vocab.values() if isinstance(v, int))
    elif isinstance(vocab, list):  # Unigram models list [piece, score] pairs
        ids.update(range(len(vocab)))
    ids.update(hf_config.added_token_ids(tokenizer_json).values())
    if not ids:
        raise ConfigError(
            "cannot tell the vocabulary size: config.json has no vocab_size and tokenizer.json no vocab"
        )
    return max(ids) + 1
