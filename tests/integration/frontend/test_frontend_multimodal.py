"""Images end to end: a frontend and a mocker worker serving the built-in ``tiny-vl`` model, as real
processes, driven by the official ``openai`` client.

What a client relies on: an image prompt is answered; its prompt tokens exceed the same text's by
exactly the image's tokens as the model's processor counts them (Qwen2-VL's rules: 224x224 px ->
(224/28)^2 = 64 ``<|image_pad|>`` tokens, plus ``<|vision_start|>`` and ``<|vision_end|>``); the same
image again is a prefix-cache hit covering it, while another image of the same size at the same
place is not (the blocks covering an image are keyed by its content, not by its placeholder
tokens, which are the same for both); the KV router sends the repeat to the worker that cached it;
a bad image is a 400 naming its part; the Responses API's ``input_image`` takes the same path.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import random
import re
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import openai
import pytest
from PIL import Image

from dynamod.daemon.frontend.preprocess.media import MediaLoader
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.daemon.models import TINY_VL_MODEL_DIR
from dynamod.shared.protocol.model_card import ModelCard
from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster, get_text

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-vl"
BLOCK = 16
IMAGE_TOKENS = 64  # 224 x 224 -> (224 / 28) ** 2
QUESTION = "Describe the picture in one short sentence, please, and name its main colour."
FOLLOW = " Answer in plain words without lists or numbers, as a note for a reader who cannot see it."


def png_url(seed: int, size: int = 224) -> str:
    """A noisy PNG (distinct pixels per seed) as a data URL."""
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), bytes(rng.getrandbits(8) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
        {"type": "text", "text": FOLLOW},
    ]}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("mm-cluster"), speedup=50.0)
    try:
        for _ in range(2):
            c.start_worker("--model", MODEL, "--block-size", str(BLOCK))
        c.start_frontend("--router-mode", "kv", "--max-images-per-request", "2", "--allowed-media-domains", "127.0.0.1")
        c.wait_ready(2, model=MODEL)
        wait_until(lambda: _resyncs_ok(c) >= 4, 15, what="the frontend's settled kv_dump reads")
        yield c
    finally:
        c.stop()


def _resyncs_ok(c: LocalCluster) -> float:
    text = get_text(c.url + "/metrics")
    return sum(float(v) for v in re.findall(r'dynamo_router_kv_resyncs_total\{outcome="ok"\} ([0-9.]+)', text))


@pytest.fixture()
def api(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _chat(api: openai.OpenAI, messages: list[dict]) -> tuple[object, str]:
    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4, extra_body={"ignore_eos": True})
    return raw.parse(), raw.headers["x-dynamo-worker-instance-id"]


def _image_offset(url: str) -> int:
    """Where the image's placeholder tokens start in the prompt, by the model's own preprocessor
    (the same files the worker publishes); the token counts themselves are checked against a
    text-only request, not against this."""
    pre = ModelPreprocessor.load(ModelCard(served_model_name=MODEL), TINY_VL_MODEL_DIR)
    request = SimpleNamespace(model=MODEL, messages=image_messages(url), tools=None, chat_template_kwargs=None,
                              add_generation_prompt=True)
    inputs = asyncio.run(pre.chat_inputs(request, MediaLoader()))
    assert inputs.mm_items is not None and inputs.mm_items[0].length == IMAGE_TOKENS
    return inputs.mm_items[0].offset


def test_image_tokens_and_cache_identity(api: openai.OpenAI) -> None:
    # The same text without the image: the image adds its 64 placeholder tokens and the two markers.
    text_only, _ = _chat(api, [{"role": "user", "content": QUESTION + FOLLOW}])
    first, worker = _chat(api, image_messages(png_url(1)))
    assert first.choices[0].message.content is not None and first.usage.completion_tokens == 4
    image_prompt = first.usage.prompt_tokens
    assert image_prompt - text_only.usage.prompt_tokens == IMAGE_TOKENS + 2, (image_prompt, text_only.usage)

    offset = _image_offset(png_url(1))
    image_end = offset + IMAGE_TOKENS
    assert first.usage.prompt_tokens_details.cached_tokens <= offset // BLOCK * BLOCK

    again, worker_again = _chat(api, image_messages(png_url(1)))
    assert worker_again == worker, "the KV router must send the repeated image to the worker that cached it"
    cached_same = again.usage.prompt_tokens_details.cached_tokens
    assert cached_same >= image_end // BLOCK * BLOCK, (cached_same, image_end)

    # Another image of the same size: the same tokens, but no block covering it is a hit (on
    # either worker: the other may hold the text-only prompt's prefix, which ends before it).
    other, _ = _chat(api, image_messages(png_url(2)))
    assert other.usage.prompt_tokens == image_prompt
    cached_other = other.usage.prompt_tokens_details.cached_tokens
    assert cached_other <= offset // BLOCK * BLOCK < cached_same, (cached_other, offset, cached_same)


def test_bad_images_are_400_naming_the_part(api: openai.OpenAI) -> None:
    bad = {
        "data:text/plain;base64,aGVsbG8=": "not an image type",
        "data:image/png;base64,aGVsbG8=": "not an image in an accepted format",
        "data:image/png;base64,%%%": "not valid base64",
        "https://example.com/cat.png": "host 'example.com' is not in",
        "ftp://example.com/cat.png": "unsupported image URL scheme",
    }
    for url, why in bad.items():
        messages = [{"role": "system", "content": "Be brief."}, image_messages(url)[0]]
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        message = info.value.body["message"]
        assert message.startswith("messages[1].content[1]: ") and why in message, message
    too_many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(3, 56)}}] * 3}]
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=too_many, max_tokens=2)
    assert info.value.body["message"].startswith("messages[0].content[2]: too many images")


def test_responses_input_image(api: openai.OpenAI) -> None:
    url = png_url(4)
    content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": url, "detail": "auto"}]
    resp = api.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=3)
    assert resp.status in ("completed", "incomplete")
    assert resp.usage.input_tokens > IMAGE_TOKENS
    content[1] = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=3)
    assert info.value.body["message"].startswith("input[0].content[1]: ")


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A local HTTP server: /cat.png an image, /hop a redirect to it, /away a redirect to a host
    the frontend does not list (``localhost``), /gone a 404."""
    png = base64.b64decode(png_url(5).split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            port = self.server.server_address[1]
            routes = {"/cat.png": (200, png, {}), "/hop": (302, b"", {"Location": "/cat.png"}),
                      "/away": (302, b"", {"Location": f"http://localhost:{port}/cat.png"})}
            status, body, headers = routes.get(self.path, (404, b"", {}))
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_image_urls_from_listed_hosts(api: openai.OpenAI, image_server: str) -> None:
    by_url, _ = _chat(api, image_messages(image_server + "/hop"))
    by_data, _ = _chat(api, image_messages(png_url(5)))
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens
    assert by_data.usage.prompt_tokens_details.cached_tokens >= by_data.usage.prompt_tokens - 2 * BLOCK  # same image
    for path, why in (("/away", "host 'localhost' is not in"), ("/gone", "HTTP 404")):
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(model=MODEL, messages=image_messages(image_server + path), max_tokens=2)
        assert info.value.body["message"].startswith("messages[0].content[1]: ") and why in info.value.body["message"]


def test_anthropic_image_blocks_take_the_same_path(api: openai.OpenAI, cluster: LocalCluster) -> None:
    """/v1/messages through the official SDK: an image block is the same prompt as the chat
    request's image part (input + cache read + cache creation = the chat prompt tokens), a repeat
    reads it from the cache, and a bad one is a 400 naming the Anthropic block."""
    import anthropic

    url = png_url(5)
    chat, _ = _chat(api, image_messages(url))
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="none", max_retries=0, timeout=30)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}}
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image, {"type": "text", "text": FOLLOW}]}]
    reply = claude.messages.create(model=MODEL, max_tokens=4, messages=messages)
    usage = reply.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert total == chat.usage.prompt_tokens, (usage, chat.usage)
    assert (usage.cache_read_input_tokens or 0) >= (_image_offset(url) + IMAGE_TOKENS) // BLOCK * BLOCK
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "x"}, bad]}])
    assert err.value.body["error"]["message"].startswith("messages[0].content[1]"), err.value.body
