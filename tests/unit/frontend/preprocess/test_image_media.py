"""Image parts in chat requests (preprocess/media): shapes, data URLs, fetching under the allow-list,
decoding, the content hash, and the chat prompt with images of the built-in ``tiny-vl`` model.

Every refusal is an ``InvalidRequestError`` (a 400) whose message starts with the part's place.
URL fetches run against httpx's ``MockTransport``: no network, but the real client code (redirects
by hand, streamed body, limits).
"""

from __future__ import annotations

import asyncio
import base64
import io
import zlib
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image

from dynamod.daemon.frontend.preprocess.media import MediaLoader, MediaSettings, collect_images
from dynamod.daemon.frontend.preprocess.media.fetch import MediaFetcher
from dynamod.daemon.frontend.preprocess.media.image import decode_image
from dynamod.daemon.frontend.preprocess.media.parts import WHERE_KEY, ImageRef
from dynamod.daemon.frontend.preprocess.media.settings import parse_domains
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.daemon.models import TINY_MODEL_DIR, TINY_VL_MODEL_DIR
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.protocol.model_card import ModelCard


def encoded(w: int, h: int, color: tuple[int, int, int] = (200, 10, 10), fmt: str = "PNG", mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color if mode == "RGB" else 0).save(buf, fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def part(url: object, detail: object = None) -> dict:
    spec: dict = {"url": url}
    if detail is not None:
        spec["detail"] = detail
    return {"type": "image_url", "image_url": spec}


def refuse(match: str) -> pytest.RaisesContext:
    return pytest.raises(InvalidRequestError, match=match)


# -- parts ------------------------------------------------------------------------------------


def test_collect_images_in_prompt_order_and_shapes() -> None:
    messages = [
        {"role": "system", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, part("data:x", "low"),
                                     {"type": "image_url", "image_url": "https://h/x.png"}]},
    ]
    refs = collect_images(messages, 4)
    assert refs == [ImageRef("messages[1].content[1]", "data:x", "low"), ImageRef("messages[1].content[2]", "https://h/x.png")]
    with refuse(r"^messages\[1\]\.content\[2\]: too many images: .* at most 1"):
        collect_images(messages, 1)
    for bad, why in ((part(""), "non-empty string"), (part("data:x", "medium"), "auto, low, high"),
                     ({"type": "image_url", "image_url": 7}, "must be an object"),
                     ({"type": "image_url", "image_url": {"url": "data:x", "size": 1}}, "unknown field 'size'")):
        with refuse(r"^messages\[0\]\.content\[0\]: .*" + why):
            collect_images([{"role": "user", "content": [bad]}], 4)
    converted = dict(part("data:x"), **{WHERE_KEY: "input[3].content[1]"})
    assert collect_images([{"role": "user", "content": [converted]}], 4)[0].where == "input[3].content[1]"


# -- data URLs and fetching -------------------------------------------------------------------


def _get(url: str, settings: MediaSettings | None = None, handler=None) -> bytes:  # noqa: ANN001
    fetcher = MediaFetcher(settings or MediaSettings(), transport=httpx.MockTransport(handler) if handler else None)

    async def run() -> bytes:
        try:
            return await fetcher.get(ImageRef("messages[0].content[1]", url))
        finally:
            await fetcher.aclose()

    return asyncio.run(run())


def test_data_urls() -> None:
    raw = encoded(8, 8)
    assert _get(data_url(raw)) == raw
    assert _get(data_url(raw).replace("base64,", "base64,\n")) == raw  # line breaks tolerated
    cases = {
        data_url(raw, "text/plain"): "not an image type",
        "data:image/png,rawbytes": "must be base64",
        "data:image/png;base64,@@@@": "not valid base64",
        "data:image/png;base64": "no ','",
        "data:image/png;base64,": "empty",
        "file:///etc/passwd": "unsupported image URL scheme",
    }
    for url, why in cases.items():
        with refuse(r"^messages\[0\]\.content\[1\]: .*" + why):
            _get(url)
    with refuse("too large: over 100 bytes"):
        _get(data_url(bytes(300)), MediaSettings(max_image_bytes=100))


def test_urls_only_for_listed_hosts_with_limits() -> None:
    raw = encoded(8, 8)
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        path = request.url.path
        if path == "/ok.png":
            return httpx.Response(200, content=raw)
        if path == "/hop":
            return httpx.Response(302, headers={"location": "/ok.png"})
        if path == "/away":
            return httpx.Response(302, headers={"location": "https://evil.example/x.png"})
        if path == "/loop":
            return httpx.Response(302, headers={"location": "/loop"})
        if path == "/big":
            return httpx.Response(200, content=bytes(5000))
        return httpx.Response(404)

    with refuse("does not fetch image URLs"):
        _get("https://img.example/ok.png", handler=handler)
    allowed = MediaSettings(allowed_domains=parse_domains(["img.example,other.example"]), max_image_bytes=4000, max_redirects=2)
    assert _get("https://IMG.example/ok.png", allowed, handler) == raw
    assert _get("https://img.example/hop", allowed, handler) == raw
    with refuse("host 'evil.example' is not in"):
        _get("https://img.example/away", allowed, handler)
    assert not any("evil" in u for u in seen), "a redirect to an unlisted host must not be followed"
    with refuse("more than 2 redirects"):
        _get("https://img.example/loop", allowed, handler)
    with refuse("too large"):
        _get("https://img.example/big", allowed, handler)
    with refuse("HTTP 404"):
        _get("https://img.example/missing.png", allowed, handler)
    with refuse("host 'img.example.evil' is not in"):
        _get("https://img.example.evil/ok.png", allowed, handler)

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with refuse("fetching the image failed: ConnectError"):
        _get("https://img.example/ok.png", allowed, broken)


def test_fetch_timeout() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, content=b"x")

    settings = MediaSettings(allowed_domains=frozenset({"img.example"}), fetch_timeout_s=0.05)
    with refuse("longer than 0.05 s"):
        _get("https://img.example/slow", settings, slow)


def test_domain_flag_parsing() -> None:
    assert parse_domains(["a.example b.example", "C.example."]) == {"a.example", "b.example", "c.example"}
    with pytest.raises(ConfigError, match="host names"):
        parse_domains(["https://a.example/"])


# -- decoding and hashing ---------------------------------------------------------------------


def test_decode_and_content_hash() -> None:
    png = decode_image(encoded(30, 20), "w", 10_000)
    assert (png.width, png.height, png.format) == (30, 20, "PNG")
    # The same pixels in another lossless format are the same image; other pixels are not.
    webp = decode_image(encoded(30, 20, fmt="WEBP"), "w", 10_000)
    lossless = io.BytesIO()
    Image.new("RGB", (30, 20), (200, 10, 10)).save(lossless, "WEBP", lossless=True)
    assert decode_image(lossless.getvalue(), "w", 10_000).content_hash == png.content_hash
    assert webp.format == "WEBP"
    assert decode_image(encoded(30, 20, (0, 0, 0)), "w", 10_000).content_hash != png.content_hash
    assert decode_image(encoded(20, 30), "w", 10_000).content_hash != png.content_hash  # same bytes count, other size


def test_bad_images_are_refused_by_name() -> None:
    with refuse(r"^m\[0\]: not an image in an accepted format"):
        decode_image(b"hello world", "m[0]", 10_000)
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, "BMP")
    with refuse("accepted format"):
        decode_image(bmp.getvalue(), "m[0]", 10_000)  # a format outside the accepted list
    with refuse(r"too large: 200x100 = 20000 pixels"):
        decode_image(encoded(200, 100), "m[0]", 10_000)
    truncated = encoded(64, 64, (1, 2, 3), fmt="JPEG")[:-200]
    with refuse("does not decode"):
        decode_image(truncated, "m[0]", 10_000)
    # A PNG header claiming a huge canvas is refused from the header, before any decoding.
    bomb = bytearray(encoded(8, 8))
    bomb[16:24] = (50_000).to_bytes(4, "big") * 2
    bomb[29:33] = zlib.crc32(bytes(bomb[12:29])).to_bytes(4, "big")  # the IHDR chunk's CRC
    with refuse("too large: .*40000000 pixels"):
        decode_image(bytes(bomb), "m[0]", 40_000_000)


# -- the chat prompt with images ----------------------------------------------------------------


def _request(messages: list) -> SimpleNamespace:
    return SimpleNamespace(model="m", messages=messages, tools=None, chat_template_kwargs=None, add_generation_prompt=True)


def test_tiny_vl_chat_prompt_with_images() -> None:
    pre = ModelPreprocessor.load(ModelCard(served_model_name="tiny-vl"), TINY_VL_MODEL_DIR)
    loader = MediaLoader(MediaSettings(max_images_per_request=3))
    red, blue = data_url(encoded(56, 56)), data_url(encoded(112, 84, (0, 0, 255)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "compare"}, part(red), part(blue, "high")]}]
    inputs = asyncio.run(pre.chat_inputs(_request(messages), loader))
    items = inputs.mm_items
    assert items is not None and [(i.length, i.width, i.height) for i in items] == [(4, 56, 56), (12, 112, 84)]
    pad = pre.vision.image_token_id
    for item in items:
        assert inputs.token_ids[item.offset - 1] == 4096 and inputs.token_ids[item.offset + item.length] == 4097
        assert set(inputs.token_ids[item.offset : item.offset + item.length]) == {pad}
    assert inputs.token_ids.count(pad) == 16
    # The same image again decodes from the loader's cache and keeps its identity.
    again = asyncio.run(pre.chat_inputs(_request(messages), loader))
    assert again == inputs and loader.decode_hits == 2
    # Text-only requests take the text path unchanged.
    text = asyncio.run(pre.chat_inputs(_request([{"role": "user", "content": "compare"}]), loader))
    assert text.mm_items is None and pad not in text.token_ids
    # A message that spells the placeholder token would shift the images: refused.
    spoof = [{"role": "user", "content": [{"type": "text", "text": "<|image_pad|>"}, part(red)]}]
    with refuse("2 image placeholder tokens for 1 images"):
        asyncio.run(pre.chat_inputs(_request(spoof), loader))


def test_text_model_refuses_images_as_before() -> None:
    pre = ModelPreprocessor.load(ModelCard(served_model_name="tiny"), TINY_MODEL_DIR)
    messages = [{"role": "user", "content": [part(data_url(encoded(8, 8)))]}]
    with refuse(r"messages\[0\]\.content\[0\]: images are not supported: this model takes text parts only"):
        asyncio.run(pre.chat_inputs(_request(messages), MediaLoader()))
