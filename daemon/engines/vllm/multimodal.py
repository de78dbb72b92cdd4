"""A request with images as vLLM's multimodal prompt, keyed so vLLM's prefix cache agrees with ours.

vLLM takes a tokenized prompt with images as ``{"prompt_token_ids", "multi_modal_data": {"image":
[PIL images]}, "multi_modal_uuids": {"image": [ids]}}`` (vllm/inputs/llm.py ``TokensPrompt``).
The prompt ids already hold each image's placeholder tokens, expanded by the frontend with the
model's own processor rules; vLLM's processor sees them applied (the images arrive at the size
those rules chose, daemon/engines/common/images.py) and keeps them, so the prompt token count
vLLM reports is the frontend's.

``multi_modal_uuids`` are the frontend's content hashes (``MultimodalItem.mm_hash``). vLLM then
uses them instead of its own hash as each image's identifier: for its encoder cache, for its
prefix-cache block keys, and in the ``extra_keys`` of the ``BlockStored`` events it publishes, which
is how the router re-keys those blocks exactly as it keys the prompt
(common/native_events.py ``with_engine_mm_keys``). So a repeated image routes to the worker that
caches it and counts as cached there. Two engine settings change the identifier vLLM keys by, and
the blocks covering images then miss in the router (never falsely hit): ``--mm-processor-kwargs``
(vLLM hashes the uuid together with them, vllm/multimodal/processing/inputs.py) and
``--enable-tower-connector-lora`` (the LoRA name is prefixed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamod.shared.protocol.llm import MultimodalItem

IMAGE = "image"


def vllm_prompt(token_ids: Sequence[int], items: Sequence[MultimodalItem], images: Sequence[Any]) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` (a TypedDict: a plain dict is one) for ``token_ids`` and its images
    (``images[i]`` the decoded pixels of ``items[i]``)."""
    if len(items) != len(images):
        raise ValueError(f"{len(items)} image items but {len(images)} decoded images")
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if items:
        prompt["multi_modal_data"] = {IMAGE: list(images)}
        prompt["multi_modal_uuids"] = {IMAGE: [item.mm_hash for item in items]}
    return prompt
