#!/usr/bin/env python3
"""Builds a tiny random LoRA adapter, in PEFT's file format, for the model of make_tiny_llama.py.

The LoRA tests load an adapter into a real engine and send a request to it; no adapter may come
from a hub, so this script writes one: ``adapter_config.json`` (PEFT ``LoraConfig`` fields) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` for the attention projections of every layer. Shapes come from the
base model's ``config.json``, so the adapter always fits the model it was made for.

Unlike a freshly initialised PEFT adapter (whose B is zero, a no-op), both matrices are random
and large enough that greedy output through the adapter differs from the base model's, which is
what lets a test tell that the adapter was really applied. Standard library only; deterministic
for a given ``--seed``.

Usage::

    python scripts/make_tiny_lora.py BASE_MODEL_DIR OUT_DIR [--rank 8] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_llama import normal, write_safetensors  # noqa: E402

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
FACTOR_STD = 0.3  # |B·A| entries around 0.1–0.5, against base weights of std 0.02


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each targeted projection."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden), "o_proj": (hidden, q_out)}


def lora_tensors(config: dict, rank: int, seed: int) -> dict[str, tuple[list[int], array]]:
    rng = random.Random(seed)
    shapes = projection_shapes(config)
    tensors: dict[str, tuple[list[int], array]] = {}
    for i in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            out_f, in_f = shapes[module]
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = ([rank, in_f], normal(rng, rank * in_f, FACTOR_STD))
            tensors[f"{prefix}.lora_B.weight"] = ([out_f, rank], normal(rng, out_f * rank, FACTOR_STD))
    return tensors


def build(base: Path, out: Path, *, rank: int = 8, seed: int = 1) -> dict:
    start = time.monotonic()
    config = json.loads((base / "config.json").read_text())
    tensors = lora_tensors(config, rank, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "adapter_model.safetensors", tensors, {"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return {
        "path": str(out),
        "rank": rank,
        "parameters": sum(math.prod(shape) for shape, _ in tensors.values()),
        "seconds": round(time.monotonic() - start, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path, help="the base model directory (made by make_tiny_llama.py)")
    p.add_argument("out", type=Path, help="directory to write the adapter into (created)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r [default 8]")
    p.add_argument("--seed", type=int, default=1, help="weight seed [default 1]")
    args = p.parse_args(argv)
    if args.rank <= 0:
        p.error("--rank must be positive")
    print(json.dumps(build(args.base, args.out, rank=args.rank, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
