"""A request's images as the native engines' own vision encoders take them (vLLM, SGLang, TRT-LLM).

The frontend has already fetched, decoded and sized every image (daemon/frontend/preprocess/media):
each ``MultimodalItem`` carries the file as the client sent it (``data``), the size the model's
processor resizes it to (``width`` x ``height``) and its content hash (``mm_hash``). An engine that
runs its own vision tower gets the pixels here: decoded with Pillow, converted to RGB and resized to
exactly that size (bicubic, as Qwen2-VL's processor resizes). The engine's processor then finds the
image already on its grid, so its resize is the identity and the placeholder count it computes is
the frontend's: prompt token counts and block positions agree on both sides. (``detail: low`` is
the case where this matters: the frontend shrank the image first, the engine would not have.)

An item without bytes (a replayed trace, a request built by hand) cannot be encoded: the request is
refused with a 400 naming the image instead of the engine failing deep inside its processor.
Decoding runs in a thread when the files are large, as the frontend's own decode does.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from typing import Any

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import MultimodalItem, PreprocessedRequest

INLINE_DECODE_BYTES = 64 * 1024  # below this in total, decoding on the event loop is cheaper
IMAGE_MODALITY = "image"


def image_items(request: PreprocessedRequest) -> list[MultimodalItem]:
    """The request's images in prompt order (empty for a text prompt); another modality is a 400."""
    items = list(request.mm_items or ())
    for i, item in enumerate(items):
        if item.modality != IMAGE_MODALITY:
            raise InvalidRequestError(f"mm_items[{i}]: modality {item.modality!r} is not supported (images only)",
                                      param="mm_items")
        if not 0 <= item.offset or item.length <= 0 or item.offset + item.length > len(request.token_ids):
            raise InvalidRequestError(
                f"mm_items[{i}]: placeholder span [{item.offset}, {item.offset + item.length}) is outside the "
                f"{len(request.token_ids)}-token prompt", param="mm_items",
            )
    return items


def decode_item(item: MultimodalItem, index: int) -> Any:
    """One item's pixels as an RGB ``PIL.Image`` at the processor's size (blocking)."""
    from PIL import Image

    if not item.data:
        raise InvalidRequestError(
            f"mm_items[{index}] (image {item.mm_hash}) carries no image bytes: this engine encodes images itself "
            "and needs them (the frontend sends them; a replayed trace does not)", param="mm_items",
        )
    try:
        with Image.open(io.BytesIO(item.data)) as img:
            rgb = img.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - the frontend checked the bytes; say what broke if not
        raise InvalidRequestError(f"mm_items[{index}] (image {item.mm_hash}) does not decode: {exc}",
                                  param="mm_items") from None
    size = (item.width, item.height)
    if item.width > 0 and item.height > 0 and rgb.size != size:
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    return rgb


def decode_items_blocking(items: Sequence[MultimodalItem]) -> list[Any]:
    return [decode_item(item, i) for i, item in enumerate(items)]


async def decode_images(items: Sequence[MultimodalItem]) -> list[Any]:
    """Every item's pixels, in order (``decode_item``); off the event loop for large files."""
    if not items:
        return []
    if sum(len(item.data) for item in items) <= INLINE_DECODE_BYTES:
        return decode_items_blocking(items)
    return await asyncio.to_thread(decode_items_blocking, items)


def image_file_bytes(image: Any, fmt: str = "PNG") -> bytes:
    """A decoded image re-encoded as a file (for engines that take image bytes or data URLs)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()
