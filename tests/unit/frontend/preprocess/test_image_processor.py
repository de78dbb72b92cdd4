"""Qwen2-VL's image processor rules (preprocess/media/processor.py) and the prompt expansion.

The expected sizes are worked out by hand from transformers' ``smart_resize`` definition (round each
side to a multiple of 28, then scale into [min_pixels, max_pixels] flooring/ceiling to 28) and vLLM's
token count ``(h/14) * (w/14) / 2^2``, for Qwen2-VL's own budget (56*56 .. 28*28*1280).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamod.daemon.frontend.preprocess.media.image import DecodedImage
from dynamod.daemon.frontend.preprocess.media.parts import ImageRef
from dynamod.daemon.frontend.preprocess.media.processor import (
    Qwen2VLRules,
    VisionProcessor,
    low_detail_size,
)
from dynamod.daemon.models import TINY_MODEL_DIR, TINY_VL_MODEL_DIR
from dynamod.shared.errors import InvalidRequestError

QWEN = Qwen2VLRules()


@pytest.mark.parametrize(
    ("h", "w", "resized", "tokens"),
    [
        (224, 224, (224, 224), 64),  # already multiples of 28
        (480, 640, (476, 644), 17 * 23),  # 480/28=17.1 -> 476, 640/28=22.9 -> 644
        (100, 100, (112, 112), 16),  # rounds up to the nearest multiple
        (20, 20, (56, 56), 4),  # under min_pixels (3136): scaled up and ceiled
        (1, 1, (56, 56), 4),
        # 2000x3000 = 6e6 px > 1003520: beta = sqrt(6e6/1003520) = 2.4452; floor(2000/2.4452/28)*28 = 812,
        # floor(3000/2.4452/28)*28 = 1204
        (2000, 3000, (812, 1204), 29 * 43),
    ],
)
def test_qwen2vl_resize_and_tokens(h: int, w: int, resized: tuple[int, int], tokens: int) -> None:
    assert QWEN.resize(h, w) == resized
    assert QWEN.num_tokens(*resized) == tokens


def test_aspect_ratio_over_200_is_refused() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        QWEN.resize(10, 2010)
    assert QWEN.resize(10, 1990)  # just under


@given(st.integers(1, 6000), st.integers(1, 6000))
def test_resize_invariants(h: int, w: int) -> None:
    """Multiples of the factor, within the pixel budget (max only by flooring, min by ceiling)."""
    if max(h, w) / min(h, w) > 200:
        return
    rh, rw = QWEN.resize(h, w)
    assert rh % 28 == 0 and rw % 28 == 0 and rh >= 28 and rw >= 28
    assert rh * rw <= max(QWEN.max_pixels, 28 * 28 * 200)
    assert QWEN.num_tokens(rh, rw) == (rh // 28) * (rw // 28)


def test_low_detail_fits_512() -> None:
    assert low_detail_size(1024, 2048) == (256, 512)
    assert low_detail_size(300, 400) == (300, 400)


def _image(w: int, h: int, content: str = "ab" * 16) -> DecodedImage:
    return DecodedImage(width=w, height=h, format="PNG", content_hash=content)


def test_tiny_vl_processor_from_its_files() -> None:
    vision = VisionProcessor.from_dir(TINY_VL_MODEL_DIR)
    assert vision is not None
    config = json.loads((TINY_VL_MODEL_DIR / "config.json").read_text())
    assert vision.image_token_id == config["image_token_id"] == 4098
    assert vision.rules == Qwen2VLRules(min_pixels=56 * 56, max_pixels=28 * 28 * 512)
    big = vision.process(ImageRef("messages[0].content[0]", "data:", "high"), _image(4000, 3000))
    # 12e6 px over the 401408 budget: beta = sqrt(12e6 / 401408) = 5.4676; floor(4000/5.4676/28)*28 = 728,
    # floor(3000/5.4676/28)*28 = 532; 26 x 19 tokens.
    assert (big.width, big.height, big.num_tokens) == (728, 532, 494)
    low = vision.process(ImageRef("messages[0].content[0]", "data:", "low"), _image(4000, 3000))
    assert (low.width, low.height) == QWEN.resize(384, 512)[::-1] and low.num_tokens < big.num_tokens
    # Another detail is another size, so another identity for the KV cache.
    assert low.mm_hash != big.mm_hash
    assert vision.process(ImageRef("x", "data:", "auto"), _image(4000, 3000)).mm_hash == big.mm_hash


def test_text_models_have_no_vision(tmp_path: Path) -> None:
    assert VisionProcessor.from_dir(TINY_MODEL_DIR) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 7}))
    assert VisionProcessor.from_dir(tmp_path) is None  # not implemented: served as text only


def test_size_keys_of_newer_processor_files(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessorFast", "size": {"shortest_edge": 1000, "longest_edge": 9000}}
    ))
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 9, "vision_config": {"patch_size": 16}}))
    vision = VisionProcessor.from_dir(tmp_path)
    assert vision is not None and vision.rules == Qwen2VLRules(patch_size=16, min_pixels=1000, max_pixels=9000)


def test_expand_places_each_image() -> None:
    vision = VisionProcessor(rules=QWEN, image_token_id=9, processor_type="Qwen2VLImageProcessor")
    a = vision.process(ImageRef("a", "data:"), _image(56, 56, "11" * 16))  # 4 tokens
    b = vision.process(ImageRef("b", "data:"), _image(112, 56, "22" * 16))  # 8 tokens
    ids, items = vision.expand([1, 8, 9, 7, 2, 8, 9, 7, 3], [a, b])
    assert ids == [1, 8, 9, 9, 9, 9, 7, 2, 8] + [9] * 8 + [7, 3]
    assert [(i.offset, i.length) for i in items] == [(2, 4), (9, 8)]
    assert all(ids[i.offset + k] == 9 for i in items for k in range(i.length))
    assert (items[1].width, items[1].height) == (112, 56) and items[0].mm_hash != items[1].mm_hash
    with pytest.raises(InvalidRequestError, match="2 image placeholder tokens for 1 images"):
        vision.expand([9, 9], [a])


def test_token_formula_matches_grid() -> None:
    for h, w in ((812, 1204), (56, 56), (28 * 7, 28 * 3)):
        assert QWEN.num_tokens(h, w) == math.prod((h // 14, w // 14)) // 4
