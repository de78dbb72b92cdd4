"""Local model resolution: the built-in ``tiny`` model and HF-style model directories."""

from .registry import TINY_MODEL_DIR, TINY_MODEL_NAME, LocalModel, load_model_dir, resolve_model

__all__ = ["TINY_MODEL_DIR", "TINY_MODEL_NAME", "LocalModel", "load_model_dir", "resolve_model"]
