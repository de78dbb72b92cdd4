"""A request with images as SGLang's ``Engine.async_generate`` arguments, and SGLang's image blocks
in its KV events keyed back as the router keys them.

SGLang takes a tokenized prompt's images as ``image_data`` beside ``input_ids`` (one entry per
image, in prompt order; a ``PIL.Image`` is accepted as is, as are bytes, paths, URLs and data URLs).
The images go in decoded at the size the frontend's processor rules chose
(daemon/engines/common/images.py), so SGLang's processor, which collapses each run of
``<|vision_start|><|image_pad|>...<|vision_end|>`` back to one image and expands it again with the
same rules, produces the frontend's token count. The adapter's ``--skip-tokenizer-init`` keeps
this working: SGLang still builds its multimodal processor for a VL model (tokenizer_manager.py).

Prefix caching: SGLang keys an image's tokens in its radix tree by a pad value,
``hash % 2**30`` of the image's hash, written in place of each of its placeholder tokens; its
``BlockStored`` events carry those pad values as token ids. Releases whose ``async_generate`` takes
``mm_hashes`` (hex strings, ``int(h, 16)`` becomes the image's hash) let the adapter give the
frontend's ``mm_hash``; it then knows each pad value's image (``ImagePads``) and turns the event's
pad values back into the placeholder token, with the image named in the block's ``extra_keys``,
as vLLM publishes it, so the router keys those blocks exactly as it keys the prompt. A release
without ``mm_hashes`` hashes images itself: its image blocks stay unknown to the router (a miss,
never a false hit). A pad value that happens to equal a real token id in the same event turns
that token into a placeholder too, which can only cost a miss.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from dynamod.shared.protocol.kv_events import BlockStored, KvEventBatch
from dynamod.shared.protocol.llm import MultimodalItem

logger = logging.getLogger(__name__)

PAD_MODULUS = 1 << 30  # SGLang's MultimodalDataItem.set_pad_value: pad_value = hash % (1 << 30)
MAX_REMEMBERED_IMAGES = 65536


def sglang_image_kwargs(items: Sequence[MultimodalItem], images: Sequence[Any], *, with_hashes: bool) -> dict[str, Any]:
    """The extra ``async_generate`` keyword arguments for a prompt's images (none for a text prompt);
    ``with_hashes``: the engine takes ``mm_hashes`` (``takes_mm_hashes``)."""
    if len(items) != len(images):
        raise ValueError(f"{len(items)} image items but {len(images)} decoded images")
    if not items:
        return {}
    kwargs: dict[str, Any] = {"image_data": list(images)}
    if with_hashes:
        kwargs["mm_hashes"] = [item.mm_hash for item in items]
    return kwargs


def takes_mm_hashes(engine: Any) -> bool:
    """Whether this SGLang's ``async_generate`` accepts ``mm_hashes`` (checked once, by signature)."""
    try:
        params = inspect.signature(engine.async_generate).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return "mm_hashes" in params


def pad_value(mm_hash: str) -> int:
    """The token id SGLang writes for each placeholder of the image whose hash is ``mm_hash`` (hex)."""
    return int(mm_hash, 16) % PAD_MODULUS


def image_token_id(model_dir: Path) -> int | None:
    """The model's image placeholder token (``config.json``), or None for a text-only model."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("image_token_id", "image_token_index"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class ImagePads:
    """Pad value -> ``mm_hash`` of the images this worker was given (bounded, least recently used
    forgotten first), and the re-keying of SGLang's stored events with it."""

    def __init__(self, image_token: int, max_images: int = MAX_REMEMBERED_IMAGES) -> None:
        self.image_token = image_token
        self.max_images = max_images
        self._hashes: OrderedDict[int, str] = OrderedDict()

    def remember(self, items: Sequence[MultimodalItem]) -> None:
        for item in items:
            pad = pad_value(item.mm_hash)
            self._hashes[pad] = item.mm_hash
            self._hashes.move_to_end(pad)
        while len(self._hashes) > self.max_images:
            self._hashes.popitem(last=False)

    def rekey(self, event: BlockStored) -> BlockStored:
        """``event`` with known pad values back as the placeholder token and each block's images in
        its ``extra_keys`` (``[mm_hash, offset of the image's first token from the block start]``)."""
        hashes = self._hashes
        if not hashes or event.block_size <= 0 or not any(t in hashes for t in event.token_ids):
            return event
        tokens = list(event.token_ids)
        size = event.block_size
        n_blocks = len(event.block_hashes)
        keys: list[list[Any]] = [[] for _ in range(n_blocks)]
        run_pad: int | None = None
        run_start = run_end = -2
        for i, token in enumerate(tokens):
            mm_hash = hashes.get(token)
            if mm_hash is None:
                continue
            tokens[i] = self.image_token
            if token != run_pad or i != run_end + 1:  # a new image starts here
                run_start, run_pad = i, token
            run_end = i
            block = i // size
            entry = [mm_hash, run_start - block * size]
            if block < n_blocks and (not keys[block] or keys[block][-1] != entry):
                keys[block].append(entry)
        extra: list[list[Any] | None] = [k or None for k in keys]
        return msgspec.structs.replace(event, token_ids=tokens, extra_keys=extra if any(extra) else None)

    def rekey_batch(self, batch: KvEventBatch) -> KvEventBatch:
        events = [self.rekey(e) if isinstance(e, BlockStored) else e for e in batch.events]
        return msgspec.structs.replace(batch, events=events)


def rekeying_decoder(decode: Callable[[bytes], KvEventBatch], pads: ImagePads | None) -> Callable[[bytes], KvEventBatch]:
    """``decode`` followed by ``pads.rekey_batch`` (just ``decode`` without image pads)."""
    if pads is None:
        return decode

    def decode_and_rekey(payload: bytes) -> KvEventBatch:
        return pads.rekey_batch(decode(payload))

    return decode_and_rekey
