#!/usr/bin/env python3
"""Builds a tiny random-weight Qwen2-VL checkpoint that vLLM (CPU build) can serve with images.

Nothing may come from a model hub, yet the real-engine multimodal test needs a vision-language
checkpoint. This script takes the project's ``tiny-vl`` files (daemon/assets/tiny-vl: tokenizer
with the vision tokens, chat template, Qwen2-VL ``config.json`` and ``preprocessor_config.json``),
instantiates ``Qwen2VLForConditionalGeneration`` from that config with transformers, and saves
random weights as safetensors beside the tokenizer and processor files. The frontend's image rules
(``Qwen2VLImageProcessor``: 28 px per token side) are therefore exactly the engine's.

Geometry changes from the assets, all for vLLM's CPU kernels: the language model's head size is
``--head-dim`` (32: CPU attention takes 32 and up in steps of 16), with the hidden size kept and
the head counts derived from it, and the multimodal rotary sections re-split to that head size
(``mrope_section`` sums to head_dim/2). The vision tower stays as in the assets.

It needs torch and transformers, so it runs in the vLLM environment (scripts/setup_vllm_env.sh).
Output is cached: ``--cache`` builds under ``~/.cache/dynamod/tiny-vl/<key>`` (``DYN_TINY_VL_CACHE``
overrides the root), the key covering this script, the asset files and the options, and reuses a
finished build; the model directory is printed on the last line of stdout. Deterministic for a
given ``--seed``.

Usage::

    python scripts/make_tiny_vl.py OUT_DIR [--seed 0] [--head-dim 32]
    python scripts/make_tiny_vl.py --cache [--seed 0] [--head-dim 32]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "daemon" / "assets" / "tiny-vl"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "generation_config.json")
DONE_MARK = ".dynamod-tiny-vl-done"
INIT_STD = 0.02


def model_config(head_dim: int) -> dict:
    """The assets' Qwen2-VL config with the language model's heads resized for CPU vLLM."""
    config = json.loads((ASSETS / "config.json").read_text(encoding="utf-8"))
    hidden = int(config["hidden_size"])
    if hidden % head_dim:
        raise SystemExit(f"make_tiny_vl: hidden_size {hidden} is not a multiple of --head-dim {head_dim}")
    heads = hidden // head_dim
    kv_heads = min(int(config.get("num_key_value_heads", heads)), heads)
    while heads % kv_heads:
        kv_heads -= 1
    config.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    # Qwen2-VL splits the rotary half-dimension into temporal, height and width sections.
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    config["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": [t, h, half - t - h]}
    # The config.json written by save_pretrained is transformers' own view of this dict.
    return config


def build(out: Path, *, seed: int, head_dim: int) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    started = time.monotonic()
    torch.manual_seed(seed)
    config = Qwen2VLConfig(**model_config(head_dim))
    config.initializer_range = INIT_STD
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in COPIED_FILES:
        shutil.copyfile(ASSETS / name, tmp / name)
    # save_pretrained rewrote generation_config.json from the model; the assets' one (eos ids) wins.
    params = sum(p.numel() for p in model.parameters())
    (tmp / DONE_MARK).write_text(json.dumps({"seed": seed, "head_dim": head_dim, "parameters": params}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    print(f"make_tiny_vl: built {out} parameters={params} seconds={time.monotonic() - started:.1f}", file=sys.stderr)


def cache_key(seed: int, head_dim: int) -> str:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(Path(__file__).read_bytes())
    for name in ("config.json", *COPIED_FILES):
        digest.update((ASSETS / name).read_bytes())
    digest.update(f"{seed}/{head_dim}".encode())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("out", nargs="?", type=Path, help="model directory to write (omit with --cache)")
    parser.add_argument("--cache", action="store_true", help="build under ~/.cache/dynamod/tiny-vl/<key>, reuse if built")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=32)
    args = parser.parse_args(argv)
    if (args.out is None) == (not args.cache):
        print("make_tiny_vl: give OUT_DIR or --cache (one of them)", file=sys.stderr)
        return 2
    if args.cache:
        root = Path(os.environ.get("DYN_TINY_VL_CACHE", "~/.cache/dynamod/tiny-vl")).expanduser()
        out = root / cache_key(args.seed, args.head_dim)
        if not (out / DONE_MARK).is_file():
            build(out, seed=args.seed, head_dim=args.head_dim)
    else:
        out = args.out
        build(out, seed=args.seed, head_dim=args.head_dim)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
