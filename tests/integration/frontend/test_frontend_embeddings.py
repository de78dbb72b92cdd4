"""``/v1/embeddings`` end to end: a real frontend process, two mocker workers in embedding mode
(``--model-type embedding``) and one chat worker, driven by the official client; and one real
vLLM pooling worker (marked ``vllm``, skipped without the vLLM environment)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from dynamod.daemon.engines.mocker.embedding import deterministic_embedding
from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from tests.integration.engines.test_vllm_support import (
    ENGINE_START_TIMEOUT_S,
    VllmCluster,
    build_tiny_model,
    vllm_python,
)
from tests.integration.frontend.test_frontend_support import LocalCluster, Proc, openai_fixture

pytestmark = pytest.mark.timeout(180)

DIMS = 48
EMBED = "tiny-embed"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("embeddings-cluster"))
    try:
        c.start_worker()
        for _ in range(2):
            c.start_worker("--model-type", "embedding", "--served-model-name", EMBED, "--embedding-dimensions", str(DIMS))
        c.start_frontend()
        c.wait_ready(1, "tiny")
        c.wait_ready(2, EMBED)
        yield c
    finally:
        c.stop()


api = openai_fixture(30)


def test_embeddings_are_the_same_on_every_worker(cluster: LocalCluster, api: openai.OpenAI) -> None:
    assert sorted(m.id for m in api.models.list().data) == ["tiny", EMBED]
    text = "dynamod serves embeddings"
    ids = Tokenizer.from_dir(TINY_MODEL_DIR).encode(text, add_special_tokens=True)
    expected = deterministic_embedding(ids, DIMS)
    seen = set()
    for value in ([text, text], [ids, ids], [text, text], [ids, ids]):  # round-robin: both workers answer
        raw = api.embeddings.with_raw_response.create(model=EMBED, input=value)
        seen.add(raw.headers["x-dynamo-worker-instance-id"])
        reply = raw.parse()
        assert len(reply.data) == 2 and reply.usage.prompt_tokens == 2 * len(ids)
        for item in reply.data:
            assert np.array_equal(np.asarray(item.embedding, dtype=np.float32), expected)
    assert len(seen) == 2

    floats = api.embeddings.create(model=EMBED, input=text, encoding_format="float", dimensions=16)
    vector = np.asarray(floats.data[0].embedding)
    assert vector.shape == (16,) and abs(np.linalg.norm(vector) - 1.0) < 1e-5
    full = expected.astype(np.float64)
    assert np.allclose(vector, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


def test_kinds_do_not_mix_and_bad_input_is_400(cluster: LocalCluster, api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        api.embeddings.create(model="tiny", input="x")
    with pytest.raises(openai.BadRequestError) as info:
        api.embeddings.create(model=EMBED, input="x", dimensions=DIMS + 1)
    assert info.value.body["param"] == "dimensions"
    with httpx.Client(base_url=cluster.url, timeout=30) as raw:
        for body in ({"model": EMBED, "input": []}, {"model": EMBED, "input": [[1], "x"]},
                     {"model": EMBED, "input": [99999999]}, {"model": EMBED, "input": "word " * 9000}):
            resp = raw.post("/v1/embeddings", json=body)
            assert resp.status_code == 400, (body, resp.text)
        # The worker's own endpoint is embed, not generate, and /health says so.
        health = raw.get("/health").json()
    endpoints = {i["endpoint"] for i in health["instances"]}
    assert {"generate", "embed"} <= endpoints
    assert {m["model"]: m.get("type") for m in health["models"]} == {"tiny": None, EMBED: "embedding"}


# ---- real vLLM (CPU build): a pooling runner over the tiny random-weight Llama --------------------

VLLM_PYTHON = vllm_python()


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM environment: run scripts/setup_vllm_env.sh")
def test_vllm_pooling_worker_serves_embeddings(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One vLLM worker with ``--model-type embedding`` (vLLM's pooling runner converts the Llama to
    an embedder), marked Matryoshka in its config so that ``dimensions`` reaches vLLM's pooler."""
    assert VLLM_PYTHON is not None
    root = tmp_path_factory.mktemp("vemb")  # short: vLLM's IPC socket paths must fit in 107 bytes
    model = root / "tinyllama"
    build_tiny_model(model)
    config = json.loads((model / "config.json").read_text())
    hidden = int(config["hidden_size"])
    (model / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    c = VllmCluster(root, VLLM_PYTHON, model)
    try:
        argv = [VLLM_PYTHON, "-m", "dynamod.daemon.cli", "--role", "agg", "--engine", "vllm", "--model", str(model),
                "--model-type", "embedding", "--served-model-name", "vllm-embed",
                "--vllm-args", "--block-size 32 --enforce-eager --max-model-len 256", *c.runtime_flags()]
        c.workers.append(Proc("vllm-embed", argv, c.env, root))
        c.start_frontend()
        api = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def served() -> bool:
            try:
                return any(m.id == "vllm-embed" for m in api.models.list().data)
            except openai.APIError:
                return False

        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not served():
            assert c.workers[0].alive(), f"vLLM worker exited:\n{c.workers[0].log()}"
            assert time.monotonic() < deadline, f"vLLM embedding model not served in {ENGINE_START_TIMEOUT_S}s"
            time.sleep(1.0)  # polling a condition with a deadline: engine start takes tens of seconds
        texts = ["hello world", "hello world", "a different sentence altogether"]
        reply = api.embeddings.create(model="vllm-embed", input=texts)
        vectors = [np.asarray(d.embedding, dtype=np.float64) for d in reply.data]
        assert [v.shape for v in vectors] == [(hidden,)] * 3
        assert all(abs(np.linalg.norm(v) - 1.0) < 1e-4 for v in vectors)  # vLLM normalises
        assert np.allclose(vectors[0], vectors[1], atol=1e-5) and not np.allclose(vectors[0], vectors[2], atol=1e-3)
        assert reply.usage.prompt_tokens > 6

        short = api.embeddings.create(model="vllm-embed", input=texts[0], dimensions=16, encoding_format="float")
        v16 = np.asarray(short.data[0].embedding)
        assert v16.shape == (16,) and np.allclose(v16, vectors[0][:16] / np.linalg.norm(vectors[0][:16]), atol=1e-4)
        with pytest.raises(openai.BadRequestError):
            api.embeddings.create(model="vllm-embed", input="x", dimensions=hidden + 1)
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model="vllm-embed", messages=[{"role": "user", "content": "x"}])
    finally:
        c.stop()
