"""The KV cache geometry of a model, read from its ``config.json``.

Disaggregated serving moves a prompt's KV blocks between workers, so the bytes of one block must be
what a real engine holds for this model: K and V for every layer and KV head, at the model's dtype.
``KvGeometry`` is that per-token shape; ``KvGeometry.layout(block_size)`` turns it into the wire
type ``KvLayout`` once the engine's block size is known.

Fields follow the HF names: ``num_hidden_layers``, ``num_key_value_heads`` (absent in pre-GQA
configs: every attention head has its own KV head), ``head_dim`` (absent in older configs:
``hidden_size / num_attention_heads``) and ``torch_dtype`` (``dtype`` in newer exports). A
multimodal config keeps them under ``text_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.kv_transfer import KvLayout

# Bytes per element of the dtypes KV caches are held in; unknown or absent -> bfloat16's 2, the
# dtype nearly every served checkpoint runs in.
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
}
DEFAULT_DTYPE_BYTES = 2


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Per-token KV shape of a model (``block_size`` comes from the engine)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    def layout(self, block_size: int) -> KvLayout:
        return KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes,
            block_size=block_size,
        )


def geometry_for_bytes_per_token(bytes_per_token: int) -> KvGeometry:
    """A stand-in geometry with ``bytes_per_token`` (one layer, one head, 1-byte elements), for
    benchmarks that want a large model's transfer sizes while serving the tiny model."""
    if bytes_per_token <= 0 or bytes_per_token % 2:
        raise ConfigError(f"--kv-bytes-per-token must be a positive even number (K and V), got {bytes_per_token}")
    return KvGeometry(num_layers=1, num_kv_heads=1, head_dim=bytes_per_token // 2, dtype_bytes=1)


def _positive_int(source: dict[str, Any], key: str) -> int | None:
    value = source.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def dtype_bytes(config: dict[str, Any]) -> int:
    name = config.get("torch_dtype") or config.get("dtype")
    if isinstance(name, str):
        return DTYPE_BYTES.get(name.removeprefix("torch.").lower(), DEFAULT_DTYPE_BYTES)
    return DEFAULT_DTYPE_BYTES


def kv_geometry(config: dict[str, Any]) -> KvGeometry | None:
    """The model's KV geometry, or None when ``config.json`` lacks the attention shape (such a
    model can still be served; only disaggregation needs the geometry, and says so)."""
    text_config = config.get("text_config")
    source = text_config if isinstance(text_config, dict) and "num_hidden_layers" in text_config else config
    layers = _positive_int(source, "num_hidden_layers")
    heads = _positive_int(source, "num_attention_heads")
    kv_heads = _positive_int(source, "num_key_value_heads") or heads
    head_dim = _positive_int(source, "head_dim")
    if head_dim is None:
        hidden = _positive_int(source, "hidden_size")
        if hidden is not None and heads is not None and hidden % heads == 0:
            head_dim = hidden // heads
    if layers is None or kv_heads is None or head_dim is None:
        return None
    return KvGeometry(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes(config | source))
