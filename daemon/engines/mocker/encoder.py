"""The mocker's vision encoder: which images an engine step encodes, and what that costs.

As in vLLM's v1 scheduler (its encoder inputs), an image is encoded whole in the step that first
computes any of its placeholder tokens: a prompt prefilled in chunks encodes each image once, in
the chunk that reaches it; an image whose tokens are all prefix-cache hits is not encoded at all
(its KV is reused, and with it the embedding's effect); one that is cached only in part is still
encoded whole, since the rest of its tokens need the embedding. A request whose prompt KV arrives
from a prefill worker (``kv_transferred``) encodes nothing here, and neither does an image whose
embedding an encode worker computed and this worker read (``MultimodalItem.embedding`` is left set
only once the read succeeded: daemon/encode/receiver.py).

The cost is linear in the image tokens encoded (``--encode-ms-per-image-token``): a ViT's work
grows with its patches, and each image token is a fixed number of them (merge_size^2, 4 for
Qwen2-VL). The encode runs before the language model's forward, so a step's time is the sum.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamod.daemon.engines.mocker.request import MockRequest

# ~50 ms for a 1000-token image: the order of Qwen2-VL-7B's 675M-parameter ViT on one A100.
DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN = 0.05


def image_tokens_to_encode(requests: Sequence[MockRequest], num_new_tokens: Sequence[int]) -> int:
    """Image tokens this step's encoder runs over, for the prefill ``requests`` scheduled with
    ``num_new_tokens`` each (before their ``num_computed_tokens`` moves on)."""
    total = 0
    for request, num_new in zip(requests, num_new_tokens, strict=True):
        items = request.mm_items
        if not items or request.kv_transferred:
            continue
        start = request.num_computed_tokens
        end = start + num_new
        first_chunk = start <= max(request.num_cached_tokens, 0)
        for item in items:
            if item.embedding is not None:  # an encode worker's embedding arrived (daemon/encode)
                continue
            lo, hi = item.offset, item.offset + item.length
            if lo < end and hi > start and (lo >= start or first_chunk):
                total += item.length
    return total


def encode_time_ms(image_tokens: int, ms_per_image_token: float) -> float:
    """Simulated encoder time of ``image_tokens`` image tokens."""
    return image_tokens * ms_per_image_token
