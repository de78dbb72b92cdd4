"""Local model resolution: the built-in ``tiny`` model and HF-style model directories."""

from .kv_layout import KvGeometry, geometry_for_bytes_per_token, kv_geometry
from .local import TINY_MODEL_DIR, TINY_MODEL_NAME, LocalModel, load_model_dir, resolve_model
from .tiny_vl import TINY_VL_MODEL_DIR, TINY_VL_MODEL_NAME

__all__ = [
    "TINY_MODEL_DIR",
    "TINY_MODEL_NAME",
    "TINY_VL_MODEL_DIR",
    "TINY_VL_MODEL_NAME",
    "KvGeometry",
    "LocalModel",
    "geometry_for_bytes_per_token",
    "kv_geometry",
    "load_model_dir",
    "resolve_model",
]
