#!/usr/bin/env python3
"""Builds a tiny random-weight Llama model directory that vLLM (and transformers) can load.

Nothing may come from a model hub, yet the real-engine tests need a real checkpoint. This script
takes our own tokenizer and Llama geometry from ``daemon/assets/tiny`` (see its README) and writes
an HF-layout model directory next to them: ``config.json``, ``model.safetensors`` with random
weights, the tokenizer files and ``generation_config.json``. A few hundred thousand parameters,
about 1.5 MB, built in well under a second.

It uses only the standard library (the safetensors format is an 8-byte header length, a JSON
header and raw little-endian tensors), so any interpreter can build the model: the project's own
environment, the vLLM venv, or CI before either has torch.

The weights are deterministic for a given ``--seed``: two builds give byte-identical files, so a
test that compares outputs across workers or runs compares the same model.

CPU vLLM's attention kernels accept only some head sizes (32 and up, in steps of 16), so the
geometry here may differ from ``config.json`` in the assets: ``--head-dim`` (default 32) is applied
and the hidden size stays, with the head counts derived from it.

Usage::

    python scripts/make_tiny_llama.py OUT_DIR [--seed 0] [--head-dim 32] [--max-position 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import struct
import sys
import time
from array import array
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "daemon" / "assets" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
INIT_STD = 0.02


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], array]], metadata: dict[str, str] | None = None) -> None:
    """Writes float32 tensors (name -> (shape, flat array('f'))) in the safetensors format.

    Layout: u64 little-endian header length, a JSON header mapping each name to dtype, shape and
    [begin, end) byte offsets into the data that follows (padded with spaces to 8 bytes).
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    blobs: list[bytes] = []
    for name in sorted(tensors):
        shape, data = tensors[name]
        if math.prod(shape) != len(data):
            raise ValueError(f"tensor {name}: shape {shape} does not hold {len(data)} values")
        if data.typecode != "f":
            raise ValueError(f"tensor {name}: expected float32 data, got typecode {data.typecode!r}")
        raw = data.tobytes() if sys.byteorder == "little" else _byteswapped(data)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def _byteswapped(data: array) -> bytes:
    copy = array(data.typecode, data)
    copy.byteswap()
    return copy.tobytes()


def normal(rng: random.Random, n: int, std: float) -> array:
    gauss = rng.gauss
    return array("f", (gauss(0.0, std) for _ in range(n)))


def ones(n: int) -> array:
    return array("f", [1.0]) * n


def llama_geometry(base: dict, head_dim: int, max_position: int | None) -> dict:
    """The asset's config with a head size CPU attention supports and heads that fill the hidden size."""
    hidden = int(base["hidden_size"])
    if head_dim <= 0 or hidden % head_dim:
        raise SystemExit(f"--head-dim {head_dim} must divide hidden_size {hidden}")
    heads = hidden // head_dim
    ratio = max(1, int(base["num_attention_heads"]) // int(base.get("num_key_value_heads") or base["num_attention_heads"]))
    kv_heads = max(1, heads // ratio)
    while heads % kv_heads:
        kv_heads -= 1
    config = dict(base)
    config.update(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    if max_position:
        config["max_position_embeddings"] = max_position
    config["torch_dtype"] = "float32"
    config.pop("transformers_version", None)
    return config


def llama_weights(config: dict, seed: int) -> dict[str, tuple[list[int], array]]:
    """Random weights for every tensor ``LlamaForCausalLM`` loads, with HF's names and shapes."""
    rng = random.Random(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    tensors: dict[str, tuple[list[int], array]] = {
        "model.embed_tokens.weight": ([vocab, hidden], normal(rng, vocab * hidden, INIT_STD)),
        "model.norm.weight": ([hidden], ones(hidden)),
    }
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = ([vocab, hidden], normal(rng, vocab * hidden, INIT_STD))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes: Iterable[tuple[str, list[int]]] = (
            ("self_attn.q_proj.weight", [q_out, hidden]),
            ("self_attn.k_proj.weight", [kv_out, hidden]),
            ("self_attn.v_proj.weight", [kv_out, hidden]),
            ("self_attn.o_proj.weight", [hidden, q_out]),
            ("mlp.gate_proj.weight", [inter, hidden]),
            ("mlp.up_proj.weight", [inter, hidden]),
            ("mlp.down_proj.weight", [hidden, inter]),
        )
        for name, shape in shapes:
            tensors[p + name] = (shape, normal(rng, math.prod(shape), INIT_STD))
        tensors[p + "input_layernorm.weight"] = ([hidden], ones(hidden))
        tensors[p + "post_attention_layernorm.weight"] = ([hidden], ones(hidden))
    return tensors


def build(out: Path, *, seed: int = 0, head_dim: int = 32, max_position: int | None = 4096) -> dict:
    """Writes the model directory; returns a summary (path, parameter count, bytes, seconds)."""
    start = time.monotonic()
    base = json.loads((ASSETS / "config.json").read_text())
    config = llama_geometry(base, head_dim, max_position)
    tensors = llama_weights(config, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, out / name)
    params = sum(len(data) for _, data in tensors.values())
    return {
        "path": str(out),
        "parameters": params,
        "bytes": (out / "model.safetensors").stat().st_size,
        "seconds": round(time.monotonic() - start, 3),
        "head_dim": config["head_dim"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to write the model into (created)")
    p.add_argument("--seed", type=int, default=0, help="weight seed [default 0]")
    p.add_argument("--head-dim", type=int, default=32, help="attention head size [default 32; CPU vLLM needs >= 32]")
    p.add_argument("--max-position", type=int, default=4096,
                   help="max_position_embeddings, i.e. the context length [default 4096]")
    args = p.parse_args(argv)
    print(json.dumps(build(args.out, seed=args.seed, head_dim=args.head_dim, max_position=args.max_position)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
