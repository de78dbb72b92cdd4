#!/usr/bin/env python3
"""Records the KV events vLLM publishes for a prompt with images, with vLLM's own code, no model.

vLLM's prefix cache keys a block that covers image placeholder tokens by the image's identifier
(``multi_modal_uuids`` when the caller gives them, its own content hash otherwise) and publishes
those keys in ``BlockStored.extra_keys``. The vision-language model cannot run on this machine's
CPU build (vLLM's Qwen2-VL needs torchvision, whose PyPI wheel is a CUDA build), so this script
drives the real pieces around the model instead: a ``Request`` with two images' ``mm_features``
(identifiers as the adapter passes them: the frontend's ``mm_hash``), vLLM's request block hasher,
its ``BlockPool`` caching the full blocks with KV events on, and its ``KVEventBatch`` msgpack
encoding, exactly as its ZMQ publisher sends a batch. Output: JSON with the prompt, the images'
spans and the base64 payload (tests/fixtures/recorded/vllm_0.32_mm_kv_events.json).

Run in the vLLM environment::

    ~/.cache/dynamod/vllm-venv/bin/python scripts/record_vllm_mm_kv_events.py OUT.json
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time

BLOCK = 16
IMAGE_TOKEN = 4098


def main(out: str) -> int:
    import msgspec
    import vllm
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    # text 0..9, image A (20 tokens at 10), text, image B (12 tokens at 34), text: 3 full blocks + tail
    images = [(hashlib.blake2b(name, digest_size=16).hexdigest(), offset, length)
              for name, offset, length in ((b"image-a", 10, 20), (b"image-b", 34, 12))]
    prompt = list(range(100, 110)) + [IMAGE_TOKEN] * 20 + [200, 201, 202, 203] + [IMAGE_TOKEN] * 12 + [300, 301, 302]
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                              mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=ident)
        for ident, offset, length in images
    ]
    request = Request("rec-1", prompt, SamplingParams(max_tokens=1), None, mm_features=features,
                      block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    n_full = len(prompt) // BLOCK
    blocks = pool.get_new_blocks(n_full)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=n_full, block_size=BLOCK,
                           kv_cache_group_id=0)
    batch = KVEventBatch(ts=time.time(), events=pool.take_events(), data_parallel_rank=0)
    payload = msgspec.msgpack.Encoder().encode(batch)
    doc = {
        "vllm_version": vllm.__version__,
        "block_size": BLOCK,
        "prompt": prompt,
        "images": [{"mm_hash": i, "offset": o, "length": n} for i, o, n in images],
        "payload": base64.b64encode(payload).decode(),
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")
    print(f"record_vllm_mm_kv_events: {len(batch.events)} event(s) -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: record_vllm_mm_kv_events.py OUT.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
