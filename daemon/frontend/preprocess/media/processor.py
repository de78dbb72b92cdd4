"""A vision-language model's image processor rules: the size each image is resized to, how many
placeholder tokens it expands to, and the expansion of the rendered prompt.

The rules are the model's own, read from its directory as vLLM and transformers read them:
``preprocessor_config.json`` names the image processor (``image_processor_type``) and its pixel
budget; ``config.json`` gives the placeholder token (``image_token_id``) and the vision tower's
patch and merge sizes (``vision_config``). Implemented: Qwen2-VL's ``Qwen2VLImageProcessor`` (also
used by Qwen2.5-VL and the fast variant), whose rules are, per transformers'
``image_processing_qwen2_vl.smart_resize`` and vLLM's ``Qwen2VLProcessingInfo._get_vision_info``:

- resize to multiples of ``factor = patch_size * merge_size`` (28), rounding each side, then, if
  the area is over ``max_pixels``, scaling down by ``sqrt(h*w/max_pixels)`` and flooring to the
  factor (never below one factor), or, if under ``min_pixels``, scaling up and ceiling;
- refuse an aspect ratio over 200;
- ``tokens = grid_t * (h/patch) * (w/patch) / merge^2`` with ``grid_t = 1`` for an image (one frame
  padded to ``temporal_patch_size``), i.e. ``(h/28) * (w/28)``;
- the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the processor
  repeats ``<|image_pad|>`` once per token.

``detail``: ``auto`` and ``high`` take the rules as they are; ``low`` first fits the image within
512x512 (OpenAI's low-resolution mode sends the model a 512 px version), so it costs fewer tokens.
A model whose processor is not one of these serves text only: its image parts are refused by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.daemon.frontend.preprocess.media.image import DecodedImage
from dynamod.daemon.frontend.preprocess.media.parts import ImageRef, image_error
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import MultimodalItem

logger = logging.getLogger(__name__)

PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"
CONFIG_FILE = "config.json"
QWEN2_VL_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast")
MAX_ASPECT_RATIO = 200
LOW_DETAIL_SIDE = 512


@dataclass(frozen=True, slots=True)
class Qwen2VLRules:
    """Qwen2-VL's resize and token-count rules (defaults: Qwen2-VL's own)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """``smart_resize``: (height, width) after the processor's resize. ``ValueError`` for an
        aspect ratio over 200."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(
                f"the image's aspect ratio is over {MAX_ASPECT_RATIO} ({width}x{height}); the model's processor refuses it"
            )
        f = self.factor
        h_bar = round(height / f) * f
        w_bar = round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def num_tokens(self, resized_height: int, resized_width: int) -> int:
        """Placeholder tokens of an image of this (resized) size: one per merged patch."""
        grid_t = 1  # an image is one frame, padded to temporal_patch_size frames
        grid_h = resized_height // self.patch_size
        grid_w = resized_width // self.patch_size
        return grid_t * grid_h * grid_w // (self.merge_size**2)


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """An image after the processor's rules: its size to the encoder, tokens and identity."""

    ref: ImageRef
    image: DecodedImage
    width: int
    height: int
    num_tokens: int
    mm_hash: str  # the content hash with the resize mixed in: what the KV blocks are keyed by
    data: bytes = b""  # the image file as fetched: engines that encode themselves decode it


def low_detail_size(height: int, width: int) -> tuple[int, int]:
    """The size a ``detail: low`` image is scaled to first: within 512x512, aspect kept."""
    longest = max(height, width)
    if longest <= LOW_DETAIL_SIDE:
        return height, width
    scale = LOW_DETAIL_SIDE / longest
    return max(1, round(height * scale)), max(1, round(width * scale))


def mm_hash(content_hash: str, width: int, height: int) -> str:
    """The identity of an image as the encoder sees it: its pixels and the size it is resized to."""
    digest = hashlib.blake2b(bytes.fromhex(content_hash), digest_size=16)
    digest.update(struct.pack("<II", width, height))
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class VisionProcessor:
    """One model's image rules and placeholder token."""

    rules: Qwen2VLRules
    image_token_id: int
    processor_type: str

    @classmethod
    def from_dir(cls, directory: Path) -> VisionProcessor | None:
        """The model's image processor, or None for a text-only model (no
        ``preprocessor_config.json``) or one whose processor is not implemented here (logged)."""
        path = directory / PREPROCESSOR_CONFIG_FILE
        if not path.is_file():
            return None
        pre = _read_json(path)
        config = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
        kind = str(pre.get("image_processor_type") or "")
        if kind not in QWEN2_VL_PROCESSORS:
            logger.warning("image processor not supported type=%s path=%s effect=text_only", kind or "?", directory)
            return None
        image_token_id = config.get("image_token_id")
        if not isinstance(image_token_id, int):
            logger.warning("vision model without image_token_id path=%s effect=text_only", directory)
            return None
        vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        defaults = Qwen2VLRules()
        rules = Qwen2VLRules(
            # vLLM takes the patch and merge sizes from the model's vision config, the pixel budget
            # from the processor's (``min_pixels``/``max_pixels``, or newer files' ``size``).
            patch_size=_int(vision.get("patch_size"), _int(pre.get("patch_size"), defaults.patch_size)),
            merge_size=_int(vision.get("spatial_merge_size"), _int(pre.get("merge_size"), defaults.merge_size)),
            temporal_patch_size=_int(vision.get("temporal_patch_size"), _int(pre.get("temporal_patch_size"), 2)),
            min_pixels=_int(pre.get("min_pixels"), _int(size.get("shortest_edge"), defaults.min_pixels)),
            max_pixels=_int(pre.get("max_pixels"), _int(size.get("longest_edge"), defaults.max_pixels)),
        )
        return cls(rules=rules, image_token_id=image_token_id, processor_type=kind)

    def process(self, ref: ImageRef, image: DecodedImage, data: bytes = b"") -> ProcessedImage:
        """The image's size to the encoder and its token count (a 400 naming the part when the
        rules refuse it); ``data``, the image file, rides along for the engine's encoder."""
        height, width = image.height, image.width
        if ref.detail == "low":
            height, width = low_detail_size(height, width)
        try:
            resized_h, resized_w = self.rules.resize(height, width)
        except ValueError as exc:
            raise image_error(ref.where, str(exc)) from None
        tokens = self.rules.num_tokens(resized_h, resized_w)
        return ProcessedImage(
            ref=ref, image=image, width=resized_w, height=resized_h, num_tokens=tokens,
            mm_hash=mm_hash(image.content_hash, resized_w, resized_h), data=data,
        )

    def expand(self, prompt_ids: Sequence[int], images: Sequence[ProcessedImage]) -> tuple[list[int], list[MultimodalItem]]:
        """The prompt with each image's placeholder token repeated ``num_tokens`` times, in order,
        and where each image's tokens are. The rendered prompt must hold exactly one placeholder
        per image: a template that drops an image, or text that spells the placeholder token,
        would shift every image after it, so either is a 400."""
        pad = self.image_token_id
        found = sum(1 for t in prompt_ids if t == pad)
        if found != len(images):
            raise InvalidRequestError(
                f"the prompt has {found} image placeholder tokens for {len(images)} images: the chat template "
                "must render each image part once, and message text must not contain the image placeholder token",
                param="messages",
            )
        out: list[int] = []
        items: list[MultimodalItem] = []
        it = iter(images)
        for token in prompt_ids:
            if token != pad:
                out.append(token)
                continue
            image = next(it)
            items.append(MultimodalItem(
                mm_hash=image.mm_hash, offset=len(out), length=image.num_tokens, width=image.width, height=image.height,
                data=image.data,
            ))
            out.extend([pad] * image.num_tokens)
        return out, items


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("unreadable model file path=%s error=%s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
