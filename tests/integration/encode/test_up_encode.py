"""``dynamod up --model tiny-vl --encode-workers 1``: the cluster comes up with an encode worker,
an image prompt through the official ``openai`` client is encoded there, and ``dynamoctl status``
lists the worker with role ``encode``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.fixtures.daemons import Up
from tests.fixtures.servers import free_port, wait_until
from tests.integration.encode.test_encode_pool import metric
from tests.integration.frontend.test_frontend_multimodal import (
    FOLLOW,
    IMAGE_TOKENS,
    QUESTION,
    image_messages,
    png_url,
)
from tests.integration.frontend.test_frontend_support import clean_env, get_json, get_text

pytestmark = pytest.mark.timeout(90)


def test_up_with_encode_workers(tmp_path: Path) -> None:
    port = free_port()
    file_kv = tmp_path / "discovery"
    env = clean_env(file_kv)
    up = Up([sys.executable, "-m", "dynamod.daemon.cli", "up", "--model", "tiny-vl", "--workers", "1",
             "--encode-workers", "1", "--http-port", str(port), "--speedup-ratio", "20", "--file-kv", str(file_kv),
             "--log-dir", str(tmp_path / "logs")], env)
    url = f"http://127.0.0.1:{port}"
    try:
        assert "encode:     1 worker(s)" in up.wait_up()
        wait_until(lambda: any(i["endpoint"] == "encode" and i["status"] == "ready"
                               for i in (get_json(url + "/health") or {}).get("instances", [])), 30, what="the encoder")
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        text = api.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": QUESTION + FOLLOW}], max_tokens=2)
        image = api.chat.completions.create(model="tiny-vl", messages=image_messages(png_url(51)), max_tokens=2)
        assert image.usage.prompt_tokens - text.usage.prompt_tokens == IMAGE_TOKENS + 2
        assert metric(get_text(url + "/metrics"), "dynamo_frontend_encode_images_total", path="remote") == 1
        status = subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "status", "--file-kv", str(file_kv)],
                                env=env, capture_output=True,
                                text=True, timeout=30)
        rows = [line.split() for line in status.stdout.splitlines()]
        assert any("dynamo/encoder" in row and "encode" in row and "ready" in row for row in rows), status.stdout
    finally:
        up.proc.terminate()
        try:
            up.proc.wait(30)
        finally:
            up.kill()
