"""Decodes an image's bytes with Pillow and names its content by hash.

Only the formats OpenAI's vision API takes are opened (PNG, JPEG, WebP, GIF: Pillow's other
decoders never see client bytes). The size is read from the header and checked against
``--max-image-pixels`` before the pixels are decoded, so a small file that claims a huge canvas
(a decompression bomb) costs nothing; a truncated or corrupt file fails the decode and is a 400.

The content hash, as vLLM's ``MultiModalHasher`` does for a PIL image (it hashes the mode and the
decoded pixel array), covers the decoded pixels, here converted to RGB (what the processor feeds
the encoder) together with the size, so the same picture sent as PNG or as lossless WebP is the
same image, and a re-encoded JPEG is another. BLAKE2b-128 (the standard library's; vLLM's default
is BLAKE3, not installed here) as 32 hex digits. The processor's resize is mixed in later
(``processor.mm_hash``): the same picture at another detail is another embedding.
"""

from __future__ import annotations

import hashlib
import io
import struct
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from dynamod.daemon.frontend.preprocess.media.parts import image_error

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_HASH_VERSION = b"dynamod-image-rgb-v1"


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """An image that decoded: its size in pixels, format and content hash (hex)."""

    width: int
    height: int
    format: str
    content_hash: str


def decode_image(data: bytes, where: str, max_pixels: int) -> DecodedImage:
    """Decodes ``data`` (blocking: call it in a thread for large images); a 400 naming ``where``
    when it is not an accepted image, claims more than ``max_pixels`` pixels, or does not decode."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except UnidentifiedImageError:
        raise image_error(where, f"not an image in an accepted format ({', '.join(ACCEPTED_FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise image_error(where, f"the image is too large: more than {max_pixels} pixels (--max-image-pixels)") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types on hostile headers
        raise image_error(where, f"the image header does not decode: {type(exc).__name__}: {exc}") from None
    with img:
        width, height = img.size
        if width <= 0 or height <= 0:
            raise image_error(where, f"the image has no pixels ({width}x{height})")
        if width * height > max_pixels:
            raise image_error(
                where, f"the image is too large: {width}x{height} = {width * height} pixels, more than "
                f"{max_pixels} (--max-image-pixels)"
            )
        fmt = img.format or "?"
        try:
            if getattr(img, "n_frames", 1) > 1:
                raise image_error(where, f"animated {fmt} images are not accepted; send one frame")
            rgb = img.convert("RGB")
        except OSError as exc:
            raise image_error(where, f"the {fmt} image does not decode (truncated or corrupt): {exc}") from None
        except Image.DecompressionBombError:
            raise image_error(where, f"the image is too large: more than {max_pixels} pixels (--max-image-pixels)") from None
    digest = hashlib.blake2b(_HASH_VERSION, digest_size=16)
    digest.update(struct.pack("<II", width, height))
    digest.update(rgb.tobytes())
    return DecodedImage(width=width, height=height, format=fmt, content_hash=digest.hexdigest())
