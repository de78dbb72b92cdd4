"""Turns a request's image parts into processed images: fetch, decode, apply the model's rules.

One ``MediaLoader`` per frontend process (on ``FrontendState``). A request's images are loaded
concurrently; a failure is reported for the first bad image in prompt order, whichever finished
first, so the same request always gets the same 400. Decoding (and hashing, and a data URL's
base64) runs on a worker thread for large files (a large PNG takes tens of ms), on the event loop
for small ones, where the thread hop costs more than the work.

Decoded images are remembered by the hash of their encoded bytes (a bounded LRU): a client that
sends the same image again (a chat history carries every earlier image on every turn) pays the
BLAKE2b of the bytes, not a decode. The processor's rules are applied per model on every request,
which costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from dynamod.daemon.frontend.preprocess.media.fetch import MediaFetcher
from dynamod.daemon.frontend.preprocess.media.image import DecodedImage, decode_image
from dynamod.daemon.frontend.preprocess.media.parts import ImageRef
from dynamod.daemon.frontend.preprocess.media.processor import ProcessedImage, VisionProcessor
from dynamod.daemon.frontend.preprocess.media.settings import MediaSettings

INLINE_DECODE_BYTES = 64 * 1024  # smaller files decode on the event loop
DECODED_CACHE_SIZE = 256


class MediaLoader:
    """Fetches, decodes and processes images under one ``MediaSettings``."""

    def __init__(self, settings: MediaSettings | None = None, fetcher: MediaFetcher | None = None) -> None:
        self.settings = settings if settings is not None else MediaSettings()
        self.fetcher = fetcher if fetcher is not None else MediaFetcher(self.settings)
        self._decoded: OrderedDict[bytes, DecodedImage] = OrderedDict()
        self.decode_hits = 0
        self.decode_misses = 0

    async def aclose(self) -> None:
        await self.fetcher.aclose()

    async def load(self, refs: Sequence[ImageRef], vision: VisionProcessor) -> list[ProcessedImage]:
        """The processed images of ``refs``, in order; the first bad one's 400 otherwise."""
        if not refs:
            return []
        if len(refs) == 1:
            return [await self._one(refs[0], vision)]
        results = await asyncio.gather(*(self._one(ref, vision) for ref in refs), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    async def _one(self, ref: ImageRef, vision: VisionProcessor) -> ProcessedImage:
        data = await self.fetcher.get(ref)
        small = len(data) <= INLINE_DECODE_BYTES
        key = _digest(data) if small else await asyncio.to_thread(_digest, data)
        image = self._decoded.get(key)
        if image is not None:
            self._decoded.move_to_end(key)
            self.decode_hits += 1
        else:
            self.decode_misses += 1
            limit = self.settings.max_image_pixels
            if small:
                image = decode_image(data, ref.where, limit)
            else:
                image = await asyncio.to_thread(decode_image, data, ref.where, limit)
            self._decoded[key] = image
            if len(self._decoded) > DECODED_CACHE_SIZE:
                self._decoded.popitem(last=False)
        return vision.process(ref, image, data)


def _digest(data: bytes) -> bytes:
    """The decoded-image cache's key: the encoded bytes' BLAKE2b-128."""
    return hashlib.blake2b(data, digest_size=16).digest()
