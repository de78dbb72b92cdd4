"""dynamoctl reading a frontend that has API keys (issue 24 item 10): real worker and frontend.

Before: ``/metrics`` answered 401 to the console's scraper, which forgot the frontend without a word,
so TTFT and ITL were ``-`` everywhere with no reason given. Now the key the frontend's own variables
name (``DYN_API_KEY``, ``--api-key-file``) is presented, and without one the missing figure comes
with one line saying why and which flag fixes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster

pytestmark = pytest.mark.timeout(120)

KEY = "console-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("ctl-keys"))
    try:
        cluster.start_worker()
        cluster.env = {**cluster.env, "DYN_API_KEY": KEY}  # the frontend's keys; the worker is started already
        cluster.start_frontend()
        cluster.env = {k: v for k, v in cluster.env.items() if k != "DYN_API_KEY"}

        def served() -> bool:
            try:
                reply = httpx.post(f"{cluster.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                   json={"model": "tiny", "prompt": "hello there", "max_tokens": 3}, timeout=10)
            except httpx.HTTPError:
                return False
            return reply.status_code == 200

        wait_until(served, 60, interval=0.3, what="a completion through the keyed frontend")
        yield cluster
    finally:
        cluster.stop()


def _status(cluster: LocalCluster, *flags: str, env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    done = subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(cluster.file_kv),
                           "status", "--json", "--wait", "5", *flags],
                          env={**cluster.env, **(env or {})}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def _worker_ttft(records: list[dict]) -> list[float | None]:
    return [(r["load"] or {}).get("ttft_s") for r in records if r["role"] == "agg"]


def test_without_a_key_the_missing_figures_say_why(keyed: LocalCluster) -> None:
    records, stderr = _status(keyed)
    assert _worker_ttft(records) == [None]
    url = f"{keyed.url}/metrics"
    assert f"dynamoctl: warning: no TTFT/ITL figures: 401 from {url}: the frontend wants a key; give --api-key-file" \
        in stderr, stderr


def test_the_frontends_own_key_variables_open_its_metrics(keyed: LocalCluster, tmp_path: Path) -> None:
    records, stderr = _status(keyed, env={"DYN_API_KEY": KEY})
    assert "warning" not in stderr, stderr
    assert all(t is not None and t > 0 for t in _worker_ttft(records)), records
    keys = tmp_path / "keys"
    keys.write_text(f"# the console's copy\n{KEY}\n")
    keys.chmod(0o600)
    records, stderr = _status(keyed, "--api-key-file", str(keys))
    assert "warning" not in stderr and _worker_ttft(records)[0] is not None, stderr


def test_a_wrong_key_is_named_as_refused_and_never_printed(keyed: LocalCluster) -> None:
    wrong = "wrong-key-0123456789abcdef"
    _, stderr = _status(keyed, env={"DYN_API_KEY": wrong})
    assert "401 from" in stderr and "the API key (DYN_API_KEY) given was refused" in stderr, stderr
    assert wrong not in stderr
