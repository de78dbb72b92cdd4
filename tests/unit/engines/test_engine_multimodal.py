"""Images through the native engine adapters (issue 26 item 6), on recorded payloads.

- vLLM's KV events for a prompt with two images, recorded with vLLM 0.32's own request block hasher,
  block pool and event encoder (scripts/record_vllm_mm_kv_events.py; the VL model itself cannot
  run on this CPU build), reach the router keyed exactly as the router keys the prompt.
- The pixels travel: a data-URL image goes through the frontend's real loader and processor into
  ``MultimodalItem.data`` and comes out of each adapter as the engine's multimodal call: vLLM's
  ``TokensPrompt`` with ``multi_modal_data``/``multi_modal_uuids``, SGLang's ``image_data``,
  TensorRT-LLM's ``TokensPrompt`` dict. The engines are replaced only at that call's edge.
- TensorRT-LLM's ``mm_keys`` (its serializer's shape) key the router's blocks the same way.
"""

from __future__ import annotations

import base64
import io
import sys
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from PIL import Image

from dynamod.daemon.engines.common.images import decode_item, image_items
from dynamod.daemon.engines.common.native_events import engine_mm_key
from dynamod.daemon.engines.common.native_kv import NativeKvEventQueue
from dynamod.daemon.engines.sglang.engine import SglangEngine
from dynamod.daemon.engines.sglang.multimodal import ImagePads, pad_value, takes_mm_hashes
from dynamod.daemon.engines.trtllm.engine import TrtllmEngine, llm_kwargs
from dynamod.daemon.engines.trtllm.kv_format import TrtllmEventMapper
from dynamod.daemon.engines.vllm.engine import VllmEngine
from dynamod.daemon.engines.vllm.outputs import OutputTracker
from dynamod.daemon.frontend.preprocess.media import ImageRef, MediaLoader, VisionProcessor
from dynamod.daemon.models.local import LocalModel, resolve_model
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.kv.hashing import compute_block_hashes, hash_tokens
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import BlockStored, KvEventBatch, KvStored, decode_native_batch
from dynamod.shared.protocol.llm import MultimodalItem, PreprocessedRequest, SamplingOptions, StopConditions
from tests.unit.engines.recorded import load

WORKER = 0x1A6E
REC = load("vllm_0.32_mm_kv_events.json")
REC_BLOCK = REC["block_size"]
REC_PROMPT: list[int] = REC["prompt"]
REC_ITEMS = [MultimodalItem(mm_hash=i["mm_hash"], offset=i["offset"], length=i["length"]) for i in REC["images"]]


def _recorded_events() -> list[Any]:
    feed = NativeKvEventQueue(WORKER)
    feed.on_batch(0, decode_native_batch(base64.b64decode(REC["payload"])))
    out = []
    while not feed._queue.empty():  # noqa: SLF001 - the test reads what the daemon would publish
        ev = feed._queue.get_nowait()
        if ev is not None:
            out.append(ev)
    return out


# ---- vLLM's KV events for image blocks ----------------------------------------------------------


def test_recorded_vllm_event_carries_the_images_per_block() -> None:
    [native] = decode_native_batch(base64.b64decode(REC["payload"])).events
    assert isinstance(native, BlockStored) and native.token_ids == REC_PROMPT[:48]
    a, b = (i.mm_hash for i in REC_ITEMS)
    # vLLM's untagged keys: [identifier, image offset relative to the block], one entry per block.
    assert native.extra_keys == [[[a, 10]], [[a, -6]], [[b, 2]]]


def test_router_keys_vllms_image_blocks_as_it_keys_the_prompt() -> None:
    [ev] = _recorded_events()
    assert isinstance(ev.event, KvStored) and len(ev.event.blocks) == 3
    local, _ = hash_tokens(REC_PROMPT, REC_BLOCK, mm_items=REC_ITEMS)
    assert [blk.tokens_hash for blk in ev.event.blocks] == local[:3]
    index = KvIndexer()
    index.apply_event(ev)
    # The same two images: all three blocks cached on the worker.
    assert index.find_matches(local).scores == {(WORKER, 0): 3}
    # Another second image of the same size, same tokens: its block (2) is a miss.
    other = [REC_ITEMS[0], MultimodalItem(mm_hash="f" * 32, offset=34, length=12)]
    assert index.find_matches(hash_tokens(REC_PROMPT, REC_BLOCK, mm_items=other)[0]).scores == {(WORKER, 0): 2}
    # Text-only hashing of the same ids (another first image, or none): block 0 already differs.
    assert index.find_matches(compute_block_hashes(REC_PROMPT, REC_BLOCK)).scores == {}


def test_engine_mm_key_takes_only_image_pairs() -> None:
    # LoRA names and cache salts are bare strings, prompt-embedding digests bare bytes.
    assert engine_mm_key(["tiny-lora", ["abc", 3], "salt", b"\x01", ["def", -4]]) == b"abcdef"
    assert engine_mm_key(None) == b"" and engine_mm_key(["tiny-lora"]) == b""


# ---- the pixels, frontend to engine call -------------------------------------------------------


def _png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def tiny_vl() -> LocalModel:
    return resolve_model("tiny-vl")


async def _frontend_request(model: LocalModel, images: list[tuple[bytes, str]]) -> PreprocessedRequest:
    """What the frontend sends a worker for ``text <image> text <image>...``: real loader and processor."""
    vision = VisionProcessor.from_dir(model.path)
    assert vision is not None
    loader = MediaLoader()
    try:
        processed = await loader.load(
            [ImageRef(where=f"messages[0].content[{i}]", url=_data_url(data), detail=detail)
             for i, (data, detail) in enumerate(images)], vision)
    finally:
        await loader.aclose()
    ids: list[int] = [7, 8, 9]
    for _ in images:
        ids += [4096, vision.image_token_id, 4097, 10]
    token_ids, items = vision.expand(ids, processed)
    return PreprocessedRequest(request_id="mm-1", model="tiny-vl", token_ids=token_ids, mm_items=items,
                               sampling=SamplingOptions(temperature=0.0), stop=StopConditions(max_tokens=2))


async def test_frontend_items_carry_the_image_bytes_and_the_engine_gets_the_processor_size(tiny_vl: LocalModel) -> None:
    big = _png(1000, 600, (200, 30, 30))
    request = await _frontend_request(tiny_vl, [(big, "low"), (_png(56, 84, (0, 0, 255)), "auto")])
    first, second = request.mm_items or []
    assert first.data == big  # the file as the client sent it
    # detail low: fitted to 512 px first, then Qwen2-VL's rules (multiples of 28).
    assert (first.width, first.height) == (504, 308) and first.length == (504 // 28) * (308 // 28)
    assert (second.width, second.height, second.length) == (56, 84, 6)
    pixels = decode_item(first, 0)
    assert pixels.size == (504, 308) and pixels.mode == "RGB"  # what the engine's encoder is given
    assert image_items(request) == [first, second]


def test_an_item_without_bytes_is_a_400_naming_the_image() -> None:
    item = MultimodalItem(mm_hash="ab" * 16, offset=3, length=4, width=56, height=56)
    with pytest.raises(InvalidRequestError, match=r"mm_items\[0\] \(image abab.*no image bytes"):
        decode_item(item, 0)
    bad = MultimodalItem(mm_hash="cd" * 16, offset=3, length=4, data=b"not an image")
    with pytest.raises(InvalidRequestError, match="does not decode"):
        decode_item(bad, 0)
    request = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2, 3, 4], mm_items=[item])
    with pytest.raises(InvalidRequestError, match="outside the 4-token prompt"):
        image_items(request)


# ---- vLLM --------------------------------------------------------------------------------------


class FakeAsyncLLM:
    """vLLM's ``AsyncLLM`` at its edge: ``generate`` records the prompt and streams one final output."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        self.calls.append({"prompt": prompt, "request_id": request_id, **kwargs})

        async def stream() -> AsyncIterator[Any]:
            completion = types.SimpleNamespace(token_ids=[5, 6], finish_reason="length", logprobs=None)
            yield types.SimpleNamespace(num_cached_tokens=0, outputs=[completion], finished=True, kv_transfer_params=None)

        return stream()


@pytest.fixture
def vllm_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names the adapter imports from vLLM when a request arrives (vLLM is not installed here)."""
    modules = {
        "vllm": {"SamplingParams": lambda **kw: types.SimpleNamespace(**kw)},
        "vllm.inputs": {"TokensPrompt": dict},
        "vllm.lora": {},
        "vllm.lora.request": {"LoRARequest": object},
        "vllm.sampling_params": {"RequestOutputKind": types.SimpleNamespace(DELTA="delta")},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.usefixtures("vllm_modules")
async def test_vllm_gets_a_multimodal_prompt_keyed_by_our_hashes(tiny_vl: LocalModel) -> None:
    request = await _frontend_request(tiny_vl, [(_png(84, 56, (10, 200, 10)), "auto"), (_png(56, 56, (1, 2, 3)), "high")])
    engine = VllmEngine([], tiny_vl, WORKER)
    fake = FakeAsyncLLM()
    engine._llm, engine._status = fake, "ready"  # noqa: SLF001 - the engine faked at its edge
    outs = [o async for o in engine.generate(request)]
    assert outs[-1].finish_reason == "length" and outs[-1].usage is not None
    assert outs[-1].usage.prompt_tokens == len(request.token_ids)
    [call] = fake.calls
    prompt = call["prompt"]
    assert prompt["prompt_token_ids"] == request.token_ids
    items = request.mm_items or []
    assert prompt["multi_modal_uuids"] == {"image": [i.mm_hash for i in items]}
    sizes = [img.size for img in prompt["multi_modal_data"]["image"]]
    assert sizes == [(i.width, i.height) for i in items] == [(84, 56), (56, 56)]
    assert prompt["multi_modal_data"]["image"][0].getpixel((0, 0)) == (10, 200, 10)


@pytest.mark.usefixtures("vllm_modules")
async def test_vllm_text_prompt_is_unchanged_and_a_bare_item_is_refused(tiny_vl: LocalModel) -> None:
    engine = VllmEngine([], tiny_vl, WORKER)
    fake = FakeAsyncLLM()
    engine._llm, engine._status = fake, "ready"  # noqa: SLF001
    text = PreprocessedRequest(request_id="t", model="tiny-vl", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2))
    [o async for o in engine.generate(text)]
    assert fake.calls[0]["prompt"] == {"prompt_token_ids": [1, 2, 3]}
    replayed = PreprocessedRequest(request_id="r", model="tiny-vl", token_ids=[1] + [4098] * 4,
                                   mm_items=[MultimodalItem(mm_hash="9" * 32, offset=1, length=4)])
    with pytest.raises(InvalidRequestError, match="no image bytes"):
        [o async for o in engine.generate(replayed)]
    assert len(fake.calls) == 1 and not engine._active  # noqa: SLF001


# ---- SGLang ------------------------------------------------------------------------------------


class FakeSglang:
    """SGLang's ``Engine`` at its edge: ``async_generate`` records its arguments."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.tokenizer_manager = types.SimpleNamespace(abort_request=lambda **kw: None)

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(kwargs)

        async def stream() -> AsyncIterator[dict[str, Any]]:
            yield {"output_ids": [5], "meta_info": {"id": "s", "finish_reason": {"type": "length", "length": 1},
                                                    "prompt_tokens": 0, "completion_tokens": 1, "cached_tokens": 0}}

        return stream()


class FakeSglangWithHashes(FakeSglang):
    """A release whose ``async_generate`` names ``mm_hashes`` (the images' hashes from the caller)."""

    async def async_generate(self, input_ids: Any = None, image_data: Any = None, mm_hashes: Any = None,
                             **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        return await super().async_generate(input_ids=input_ids, image_data=image_data, mm_hashes=mm_hashes, **kwargs)


async def test_sglang_gets_image_data_beside_input_ids(tiny_vl: LocalModel) -> None:
    request = await _frontend_request(tiny_vl, [(_png(112, 56, (9, 9, 9)), "auto")])
    engine = SglangEngine([], tiny_vl, WORKER)
    fake = FakeSglang()
    engine._engine, engine._status = fake, "ready"  # noqa: SLF001 - the engine faked at its edge
    engine._takes_mm_hashes = takes_mm_hashes(fake)  # noqa: SLF001 - as _start sets it
    [o async for o in engine.generate(request)]
    [call] = fake.calls
    assert call["input_ids"] == request.token_ids and "mm_hashes" not in call  # this release hashes itself
    [image] = call["image_data"]
    assert isinstance(image, Image.Image) and image.size == (112, 56) and image.mode == "RGB"
    text = PreprocessedRequest(request_id="t", model="tiny-vl", token_ids=[1, 2], stop=StopConditions(max_tokens=1))
    [o async for o in engine.generate(text)]
    assert "image_data" not in fake.calls[1]


async def test_sglang_takes_our_hashes_and_its_pad_values_key_back_to_them(tiny_vl: LocalModel) -> None:
    request = await _frontend_request(tiny_vl, [(_png(56, 56, (5, 5, 5)), "auto")])
    engine = SglangEngine([], tiny_vl, WORKER)
    fake = FakeSglangWithHashes()
    engine._engine, engine._status = fake, "ready"  # noqa: SLF001 - the engine faked at its edge
    engine._takes_mm_hashes = takes_mm_hashes(fake)  # noqa: SLF001
    [o async for o in engine.generate(request)]
    [item] = request.mm_items or []
    assert fake.calls[0]["mm_hashes"] == [item.mm_hash]
    pads = engine._image_pads  # noqa: SLF001
    assert pads is not None and pads.image_token == 4098
    # What SGLang publishes for that prompt: its pad value in place of each placeholder token.
    size = 4
    n = len(request.token_ids) // size
    sglang_tokens = [pad_value(item.mm_hash) if t == 4098 else t for t in request.token_ids[: n * size]]
    event = BlockStored(block_hashes=list(range(1, n + 1)), parent_block_hash=None, token_ids=sglang_tokens,
                        block_size=size)
    keyed = pads.rekey(event)
    assert keyed.token_ids == request.token_ids[: n * size]
    assert keyed.extra_keys is not None and any(keyed.extra_keys) and not all(keyed.extra_keys)
    feed = NativeKvEventQueue(WORKER)
    feed.on_batch(0, KvEventBatch(ts=0.0, events=[keyed]))
    ev = feed._queue.get_nowait()  # noqa: SLF001
    assert [b.tokens_hash for b in ev.event.blocks] == hash_tokens(request.token_ids, size, mm_items=request.mm_items)[0]
    # Without re-keying, SGLang's pad values match nothing the router computes for the prompt.
    assert compute_block_hashes(sglang_tokens, size) != hash_tokens(request.token_ids, size, mm_items=request.mm_items)[0]
    # A text event, or an image this worker was not given, passes unchanged.
    text = BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4)
    assert pads.rekey(text) is text
    unknown = BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[7] + [123456789] * 3, block_size=4)
    assert pads.rekey(unknown) is unknown


def test_sglang_two_images_in_one_block_are_named_in_order() -> None:
    pads = ImagePads(image_token=4098)
    a, b = MultimodalItem(mm_hash="a1" * 16, offset=0, length=2), MultimodalItem(mm_hash="b2" * 16, offset=3, length=3)
    pads.remember([a, b])
    prompt = [4098, 4098, 11, 4098, 4098, 4098, 12, 13]
    sg = [pad_value(a.mm_hash) if i in (0, 1) else pad_value(b.mm_hash) if i in (3, 4, 5) else t
          for i, t in enumerate(prompt)]
    keyed = pads.rekey(BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=sg, block_size=4))
    assert keyed.token_ids == prompt
    # [image, offset of its first token from the block's start], as vLLM publishes them.
    assert keyed.extra_keys == [[[a.mm_hash, 0], [b.mm_hash, 3]], [[b.mm_hash, -1]]]
    assert [engine_mm_key(k) for k in keyed.extra_keys] == [(a.mm_hash + b.mm_hash).encode(), b.mm_hash.encode()]


# ---- TensorRT-LLM ------------------------------------------------------------------------------


class FakeTrtllm:
    """``tensorrt_llm.LLM`` at its edge: ``generate_async`` records its input."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def generate_async(self, inputs: Any, **kwargs: Any) -> Any:
        self.calls.append({"inputs": inputs, **kwargs})

        class Result:
            def abort(self) -> None:
                return None

            async def __aiter__(self) -> AsyncIterator[Any]:
                completion = types.SimpleNamespace(token_ids_diff=[5], finish_reason="length", disaggregated_params=None)
                yield types.SimpleNamespace(outputs=[completion], finished=True, cached_tokens=0)

        return Result()


@pytest.fixture
def trtllm_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    root = types.ModuleType("tensorrt_llm")
    root.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    executor = types.ModuleType("tensorrt_llm.executor")
    executor.LoRARequest = object  # type: ignore[attr-defined]
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.DisaggregatedParams = object  # type: ignore[attr-defined]
    for name, module in (("tensorrt_llm", root), ("tensorrt_llm.executor", executor), ("tensorrt_llm.llmapi", llmapi)):
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.usefixtures("trtllm_modules")
async def test_trtllm_gets_a_tokens_prompt_with_images_and_uuids(tiny_vl: LocalModel) -> None:
    request = await _frontend_request(tiny_vl, [(_png(56, 56, (1, 1, 1)), "auto"), (_png(56, 112, (2, 2, 2)), "auto")])
    engine = TrtllmEngine(llm_kwargs("", model_path=str(tiny_vl.path), context_length=None), tiny_vl, WORKER)
    fake = FakeTrtllm()
    engine._llm, engine._status = fake, "ready"  # noqa: SLF001 - the engine faked at its edge
    [o async for o in engine.generate(request)]
    inputs = fake.calls[0]["inputs"]
    items = request.mm_items or []
    assert inputs["prompt_token_ids"] == request.token_ids
    assert inputs["multi_modal_uuids"] == {"image": [i.mm_hash for i in items]}
    assert [img.size for img in inputs["multi_modal_data"]["image"]] == [(56, 56), (56, 112)]
    text = PreprocessedRequest(request_id="t", model="tiny-vl", token_ids=[1, 2], stop=StopConditions(max_tokens=1))
    [o async for o in engine.generate(text)]
    assert fake.calls[1]["inputs"] == [1, 2]  # a text prompt stays a list of ids


def test_trtllm_mm_keys_key_the_routers_blocks() -> None:
    """A stored event in ``KVCacheEventSerializer``'s shape for REC's prompt (block 16), its
    image blocks carrying ``mm_keys`` with the uuids the adapter sent."""
    a, b = REC_ITEMS
    mm = {0: [(a.mm_hash, 10)], 1: [(a.mm_hash, -6)], 2: [(b.mm_hash, 2)]}
    blocks = [
        {"type": "stored_block", "block_hash": 1000 + i, "cache_level": 0, "priority": 35,
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in REC_PROMPT[i * 16:(i + 1) * 16]],
         "mm_keys": [{"type": "mm_key", "hash": h, "start_offset": off} for h, off in mm[i]]}
        for i in range(3)
    ]
    mapper = TrtllmEventMapper(block_size=REC_BLOCK)
    batch = mapper.map({"event_id": 7, "window_size": 4096, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}})
    assert batch is not None
    [native] = batch.events
    assert isinstance(native, BlockStored) and native.extra_keys == [[[a.mm_hash, 10]], [[a.mm_hash, -6]], [[b.mm_hash, 2]]]
    feed = NativeKvEventQueue(WORKER)
    feed.on_batch(0, batch)
    ev = feed._queue.get_nowait()  # noqa: SLF001
    assert [blk.tokens_hash for blk in ev.event.blocks] == hash_tokens(REC_PROMPT, REC_BLOCK, mm_items=REC_ITEMS)[0][:3]
    # The V2 cache manager's shape: its content digest as hash, the request's uuid beside it.
    v2 = dict(blocks[2], mm_keys=[{"type": "mm_key", "hash": "0" * 64, "uuid": b.mm_hash, "start_offset": 2}])
    v2_batch = TrtllmEventMapper(block_size=REC_BLOCK).map({"event_id": 1, "data": {"type": "stored", "blocks": [v2]}})
    assert v2_batch is not None and v2_batch.events[0].extra_keys == [[[b.mm_hash, 2]]]
    # A text block has no mm_keys: no extra keys at all.
    plain = dict(blocks[0], mm_keys=[])
    text_batch = TrtllmEventMapper(block_size=REC_BLOCK).map({"event_id": 1, "data": {"type": "stored", "blocks": [plain]}})
    assert text_batch is not None and text_batch.events[0].extra_keys is None



def test_vllm_usage_reports_the_engines_prompt_length_when_it_differs(caplog: pytest.LogCaptureFixture) -> None:
    """If vLLM's processor expanded an image to another token count than the frontend, the usage
    says what the engine really prefilled, and the worker log says why the router's keys miss."""
    tracker = OutputTracker(prompt_tokens=20)
    completion = types.SimpleNamespace(token_ids=[5], finish_reason="length", logprobs=None)
    out = tracker.map(types.SimpleNamespace(num_cached_tokens=16, outputs=[completion], finished=True,
                                            prompt_token_ids=list(range(26))))
    assert out is not None and out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.cached_tokens) == (26, 16)
    assert "prompt length differs" in caplog.text
    same = OutputTracker(prompt_tokens=26)
    final = same.map(types.SimpleNamespace(num_cached_tokens=0, outputs=[completion], finished=True,
                                           prompt_token_ids=list(range(26))))
    assert final is not None and final.usage is not None and final.usage.prompt_tokens == 26
