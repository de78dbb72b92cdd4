"""Images through real vLLM (CPU build) behind the real frontend (issue 26 item 6).

One ``dynamod --role agg --engine vllm`` worker hosting a tiny random-weight Qwen2-VL built locally
(scripts/make_tiny_vl.py: the project's tiny-vl tokenizer and processor files, random weights,
cached under ~/.cache/dynamod/tiny-vl) and a KV-routing frontend, as real processes, driven by the
``openai`` client. What a client relies on:

- the checkpoint works (transformers generates from an image with it) and its own image processor
  counts every image's tokens as the frontend does (runs wherever the vLLM environment exists);
- an image prompt answers, and its prompt tokens exceed the same text's by the image's tokens as
  the frontend's processor rules count them plus ``<|vision_start|>``/``<|vision_end|>``; the count
  is vLLM's own (the adapter adopts vLLM's if they differ and logs it: the log must not say so);
- the same image again reports cached tokens covering it (vLLM's prefix cache, keyed by the
  frontend's ``mm_hash`` passed as the image's uuid), another image of the same size does not.

Needs the vLLM environment (scripts/setup_vllm_env.sh) and a vLLM that can load Qwen2-VL there:
vLLM 0.32's Qwen2-VL imports transformers' torchvision image processor, and the only torchvision
wheels this machine's package index offers are CUDA builds that do not load against CPU torch
("operator torchvision::nms does not exist"), so here the module skips with that error. Engine
start is 20-45 s on 2 cores; everything shares one worker.
"""

from __future__ import annotations

import base64
import io
import json
import random
import subprocess
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

from dynamod.daemon.frontend.preprocess.media import VisionProcessor
from tests.fixtures.servers import wait_until
from tests.integration.engines.test_vllm_support import (
    ENGINE_START_TIMEOUT_S,
    ROOT,
    VllmCluster,
    vllm_marks,
    vllm_python,
)
from tests.integration.frontend.test_frontend_support import get_json

VLLM_PYTHON = vllm_python()
pytestmark = vllm_marks(VLLM_PYTHON)

MODEL = "tinyvl"
BLOCK = 16
SIDE = 112  # 112 x 112 px -> (112 / 28) ** 2 = 16 image tokens, one block
IMAGE_TOKENS = (SIDE // 28) ** 2
VLLM_ARGS = f"--block-size {BLOCK} --enforce-eager --max-model-len 2048 --max-num-seqs 4"
QUESTION = "Describe the picture in one short sentence, please."


def _qwen2_vl_blocker(python: str) -> str | None:
    """Why vLLM's Qwen2-VL cannot load in that environment (its import's last error line), or None."""
    probe = subprocess.run([python, "-c", "import vllm.model_executor.models.qwen2_vl"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode == 0:
        return None
    lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {probe.returncode}"


def png_url(seed: int) -> str:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (SIDE, SIDE), bytes(rng.getrandbits(8) for _ in range(SIDE * SIDE * 3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str | None) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def tiny_vl_dir() -> Path:
    """The cached random-weight Qwen2-VL checkpoint (built in the vLLM environment on first use)."""
    assert VLLM_PYTHON is not None
    built = subprocess.run([VLLM_PYTHON, str(ROOT / "scripts" / "make_tiny_vl.py"), "--cache"], check=True,
                           capture_output=True, text=True, timeout=300)
    return Path(built.stdout.strip().splitlines()[-1])


# Runs in the vLLM environment: transformers' own Qwen2-VL image processor (its Pillow backend, which
# needs no torchvision) sizes images, and the checkpoint generates from an image with transformers.
HF_CHECK = """
import json, sys
import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
model_dir, sizes = sys.argv[1], json.loads(sys.argv[2])
pre = json.load(open(model_dir + "/preprocessor_config.json"))
proc = Qwen2VLImageProcessorPil(**{k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class")})
out = {}
for w, h in sizes:
    t, gh, gw = proc(images=[Image.new("RGB", (w, h), (9, 9, 9))], return_tensors="pt")["image_grid_thw"][0].tolist()
    out[f"{w}x{h}"] = [gw * 14, gh * 14, t * gh * gw // 4]
model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
pix = proc(images=[Image.new("RGB", (56, 84), (200, 0, 0))], return_tensors="pt")
ids = torch.tensor([[4088, 5, 4096] + [4098] * 6 + [4097, 7]])
gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix["pixel_values"],
                     image_grid_thw=pix["image_grid_thw"], max_new_tokens=3, do_sample=False)
out["generated"] = gen.shape[1] - ids.shape[1]
print(json.dumps(out))
"""


def test_tiny_vl_checkpoint_runs_and_its_processor_counts_as_the_frontend(tiny_vl_dir: Path) -> None:
    """The checkpoint the vLLM test serves is a working Qwen2-VL (transformers generates from an
    image with it), and the model's own image processor sizes images, and so counts their tokens,
    exactly as the frontend's rules do (the count vLLM's processor takes from it)."""
    assert VLLM_PYTHON is not None
    sizes = [(1000, 600), (56, 84), (504, 308), (640, 480), (33, 1000), (SIDE, SIDE)]
    run = subprocess.run([VLLM_PYTHON, "-c", HF_CHECK, str(tiny_vl_dir), json.dumps(sizes)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    hf = json.loads(run.stdout.strip().splitlines()[-1])
    assert hf.pop("generated") == 3
    vision = VisionProcessor.from_dir(tiny_vl_dir)
    assert vision is not None
    ours = {}
    for w, h in sizes:
        rh, rw = vision.rules.resize(h, w)
        ours[f"{w}x{h}"] = [rw, rh, vision.rules.num_tokens(rh, rw)]
    assert hf == ours


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_vl_dir: Path) -> Iterator[VllmCluster]:
    assert VLLM_PYTHON is not None
    blocker = _qwen2_vl_blocker(VLLM_PYTHON)
    if blocker is not None:
        pytest.skip(f"vLLM's Qwen2-VL does not load in {VLLM_PYTHON}: {blocker}")
    root = tmp_path_factory.mktemp("vllm-mm")
    model = root / MODEL  # the served name is the directory's
    model.symlink_to(tiny_vl_dir, target_is_directory=True)
    c = VllmCluster(root, VLLM_PYTHON, model)
    try:
        c.start_worker(VLLM_ARGS)
        c.start_frontend("--router-mode", "kv")
        wait_until(lambda: _ready(c), ENGINE_START_TIMEOUT_S, interval=0.5, what="a ready vLLM worker")
        yield c
    finally:
        c.stop()


def _ready(c: VllmCluster) -> bool:
    for proc in c.workers:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
    try:
        body = get_json(c.url + "/health")
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return any(m["model"] == MODEL and any(w["status"] == "ready" for w in m["workers"]) for m in body.get("models", []))


@pytest.fixture
def api(cluster: VllmCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(api: openai.OpenAI, url: str | None) -> openai.types.CompletionUsage:
    resp = api.chat.completions.create(model=MODEL, messages=messages(url), max_tokens=2, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage is not None
    return resp.usage


def test_image_prompt_counts_and_caches_as_vllm_does(cluster: VllmCluster, api: openai.OpenAI) -> None:
    text = _ask(api, None)
    first = _ask(api, png_url(1))
    # vLLM's count (the adapter reports it) is the frontend's: the image's tokens and its two markers.
    assert first.prompt_tokens == text.prompt_tokens + IMAGE_TOKENS + 2
    assert "prompt length differs" not in cluster.workers[0].log()
    again = _ask(api, png_url(1))
    cached = again.prompt_tokens_details.cached_tokens if again.prompt_tokens_details else 0
    # The whole prompt but the last token, in full blocks (vLLM always computes the last token).
    assert cached == ((first.prompt_tokens - 1) // BLOCK) * BLOCK
    other = _ask(api, png_url(2))
    other_cached = other.prompt_tokens_details.cached_tokens if other.prompt_tokens_details else 0
    # Same size, same placeholder tokens, another picture: a hit only before the image's first block.
    assert other.prompt_tokens == first.prompt_tokens
    assert other_cached < cached and other_cached <= first.prompt_tokens - IMAGE_TOKENS - 1
