"""Images in requests: finding the parts, fetching and decoding them, the model's processor rules.

    messages -> parts.collect_images (shapes, count) -> loader.MediaLoader.load
             -> fetch.MediaFetcher.get (data: URL or allowed http(s) host) -> image.decode_image
             -> processor.VisionProcessor.process (resize, tokens, mm_hash)
    rendered prompt ids -> VisionProcessor.expand -> ids with placeholders + MultimodalItem list

``settings.MediaSettings`` holds the operator's limits (``--allowed-media-domains`` and friends).
"""

from .loader import MediaLoader
from .parts import ImageRef, collect_images, has_images, image_error
from .processor import ProcessedImage, Qwen2VLRules, VisionProcessor
from .settings import MediaSettings, add_media_args, media_settings_from_args

__all__ = [
    "ImageRef",
    "MediaLoader",
    "MediaSettings",
    "ProcessedImage",
    "Qwen2VLRules",
    "VisionProcessor",
    "add_media_args",
    "collect_images",
    "has_images",
    "image_error",
    "media_settings_from_args",
]
