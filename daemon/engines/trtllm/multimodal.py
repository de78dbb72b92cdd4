"""A request with images as TensorRT-LLM's ``LLM.generate_async`` input.

TensorRT-LLM's LLM API takes a tokenized prompt with images as a ``TokensPrompt`` dict
(tensorrt_llm/inputs/data.py): ``{"prompt_token_ids", "multi_modal_data": {"image": [...]},
"multi_modal_uuids": {"image": [...]}}``; a text prompt stays a plain list of token ids. The images
go in decoded at the size the frontend's processor rules chose (daemon/engines/common/images.py).

``multi_modal_uuids`` are the frontend's content hashes (``MultimodalItem.mm_hash``): TensorRT-LLM
then reports them, instead of its own content hash, in the ``mm_keys`` of the stored blocks in its
KV cache events, which kv_format.py passes to the router as the blocks' image keys, so a repeated
image counts as cached. A release without ``multi_modal_uuids`` reports its own hashes: those
blocks then miss in the router (never a false hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamod.shared.protocol.llm import MultimodalItem

IMAGE = "image"


def trtllm_prompt(token_ids: Sequence[int], items: Sequence[MultimodalItem], images: Sequence[Any]) -> list[int] | dict[str, Any]:
    """``generate_async``'s first argument for ``token_ids`` and its images (``images[i]`` the
    decoded pixels of ``items[i]``)."""
    if len(items) != len(images):
        raise ValueError(f"{len(items)} image items but {len(images)} decoded images")
    if not items:
        return list(token_ids)
    return {
        "prompt_token_ids": list(token_ids),
        "multi_modal_data": {IMAGE: list(images)},
        "multi_modal_uuids": {IMAGE: [item.mm_hash for item in items]},
    }
