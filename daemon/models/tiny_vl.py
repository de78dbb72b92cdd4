"""The built-in ``tiny-vl`` vision-language model: ``tiny`` plus what a Qwen2-VL model directory adds.

dynamod never downloads a model, so the multimodal path (image parts, the image processor's rules,
image tokens in usage and in KV block hashes) needs a vision-language model that ships with the
package. ``tiny-vl`` is the ``tiny`` model (daemon/assets/tiny: its byte-level BPE tokenizer,
Llama-3.1-style chat template and tiny geometry) extended the way Qwen2-VL extends its language
model:

- three added special tokens after tiny's vocabulary: ``<|vision_start|>`` (4096),
  ``<|vision_end|>`` (4097) and ``<|image_pad|>`` (4098, the image placeholder the processor
  repeats once per image token);
- ``config.json`` with Qwen2-VL's keys (``model_type`` ``qwen2_vl``, ``image_token_id``,
  ``vision_start_token_id``, ``vision_end_token_id`` and a ``vision_config`` with the patch and
  merge sizes the processor reads);
- ``preprocessor_config.json`` naming ``Qwen2VLImageProcessor`` with Qwen2-VL's patch 14, merge 2,
  temporal patch 2 and a small pixel budget (min 56x56, max 28x28x512: 4 to 512 tokens per image);
- a chat template that renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``.

The files are generated from tiny's by ``build`` and shipped in ``daemon/assets/tiny-vl``
(``python -m dynamod.daemon.models.tiny_vl`` rewrites them; tests/unit/multimodal checks that the
shipped files are what this module builds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dynamod.shared.cli_parser import ArgumentParser

TINY_VL_MODEL_NAME = "tiny-vl"
_ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_DIR = _ASSETS / "tiny"
TINY_VL_MODEL_DIR = _ASSETS / TINY_VL_MODEL_NAME

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD)
FIRST_VISION_ID = 4096  # right after tiny's 4096-token vocabulary

# Qwen2-VL's image processor settings, with a pixel budget sized for an 8k-token context.
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 512
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# tiny's render_content macro, with image parts rendered as Qwen2-VL's placeholder.
_TINY_TEXT_ONLY = (
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}\n"
    "{%- else -%}{{ raise_exception('Only text content parts are supported, got ' ~ part['type']) }}"
)
_VL_PARTS = (
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}\n"
    "{%- elif part['type'] in ['image', 'image_url'] -%}"
    + VISION_START + IMAGE_PAD + VISION_END + "\n"
    "{%- else -%}{{ raise_exception('Only text and image content parts are supported, got ' ~ part['type']) }}"
)

_README = """# The "tiny-vl" model assets

`resolve_model("tiny-vl")` serves these files. They are generated from `../tiny` by
`daemon/models/tiny_vl.py` (`python -m dynamod.daemon.models.tiny_vl`); edit that module and re-run
it rather than editing them by hand.

| file | what it is |
| --- | --- |
| `tokenizer.json` | tiny's byte-level BPE plus `<|vision_start|>` 4096, `<|vision_end|>` 4097, `<|image_pad|>` 4098 |
| `tokenizer_config.json` | tiny's, with the three tokens and a chat template that renders an image part as `<|vision_start|><|image_pad|><|vision_end|>` |
| `config.json` | tiny's geometry under Qwen2-VL's keys (`model_type` `qwen2_vl`, `image_token_id`, `vision_config` with patch 14, merge 2) |
| `preprocessor_config.json` | `Qwen2VLImageProcessor`: images resized to multiples of 28 px within 56x56..28x28x512 pixels; tokens = (h/14/2)*(w/14/2) |
| `generation_config.json` | tiny's (eos ids 4089, 4093, 4092) |

Licence: as `../tiny` (Apache-2.0, part of dynamod).
"""


def _read(name: str) -> Any:
    return json.loads((TINY_DIR / name).read_text(encoding="utf-8"))


def _dump(data: object) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _added_token(token_id: int, content: str) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def build() -> dict[str, str]:
    """The tiny-vl files (name -> text), derived from tiny's."""
    vision_ids = {tok: FIRST_VISION_ID + i for i, tok in enumerate(VISION_TOKENS)}
    tokenizer = _read("tokenizer.json")
    known = {t["content"] for t in tokenizer["added_tokens"]}
    tokenizer["added_tokens"] += [_added_token(i, tok) for tok, i in vision_ids.items() if tok not in known]

    tok_config = _read("tokenizer_config.json")
    template = tok_config["chat_template"]
    if _TINY_TEXT_ONLY not in template:
        raise RuntimeError("tiny's chat template changed: update tiny_vl._TINY_TEXT_ONLY")
    tok_config["chat_template"] = template.replace(_TINY_TEXT_ONLY, _VL_PARTS)
    decoder = tok_config["added_tokens_decoder"]
    for tok, i in vision_ids.items():
        decoder[str(i)] = {k: v for k, v in _added_token(i, tok).items() if k != "id"}

    tiny = _read("config.json")
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "vocab_size": FIRST_VISION_ID + len(VISION_TOKENS),
        **{k: tiny[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps")},
        "rope_theta": 1000000.0,
        # M-RoPE splits each head's rotary half (head_dim 16 -> 8) into temporal, height, width.
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        **{k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "vision_start_token_id": vision_ids[VISION_START],
        "vision_end_token_id": vision_ids[VISION_END],
        "image_token_id": vision_ids[IMAGE_PAD],
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": tiny["hidden_size"],
            "hidden_act": "quick_gelu",
            "mlp_ratio": 2,
            "num_heads": 4,
            "in_chans": 3,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
    }
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "do_convert_rgb": True,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    return {
        "tokenizer.json": _dump(tokenizer),
        "tokenizer_config.json": _dump(tok_config),
        "config.json": _dump(config),
        "preprocessor_config.json": _dump(preprocessor),
        "generation_config.json": (TINY_DIR / "generation_config.json").read_text(encoding="utf-8"),
        "README.md": _README,
    }


def write(out: Path = TINY_VL_MODEL_DIR) -> list[Path]:
    """Writes the files into ``out`` (created if missing); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in build().items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description="Writes the built-in tiny-vl model's files (from tiny's).")
    parser.add_argument("--out", type=Path, default=TINY_VL_MODEL_DIR, help="directory [default: the shipped assets]")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
