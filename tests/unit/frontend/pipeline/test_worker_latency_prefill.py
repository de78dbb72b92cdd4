"""The frontend's per-worker latency gauges keep local and remote prefills apart (issue 24 item 12):
a decode worker's TTFT after the prefill pool did the prompt and after it prefilled the prompt
itself (fallback, conditional disaggregation) are two series, so the console compares like with
like. In-process disaggregated cluster (``disagg_cluster.py``)."""

from __future__ import annotations

import re

import httpx

from dynamod.shared.protocol.worker_id import worker_id_hex
from tests.unit.frontend.disagg_cluster import DisaggCluster

PROMPT = list(range(1, 101))


def _series(text: str, wid: int) -> dict[str, float]:
    """prefill label -> value of the worker's last-TTFT gauge."""
    out = {}
    for labels, value in re.findall(r"^dynamo_frontend_worker_last_time_to_first_token_seconds\{([^}]*)\} (\S+)$", text, re.M):
        if f'worker_id="{worker_id_hex(wid)}"' in labels:
            out[re.search(r'prefill="(\w+)"', labels).group(1)] = float(value)
    return out


async def test_remote_and_fallback_local_prefills_are_separate_series() -> None:
    c = DisaggCluster("--prefill-timeout", "1")
    await c.start()
    try:
        decode = await c.add_decode()
        prefill = await c.add_prefill()
        async with httpx.AsyncClient(base_url=c.url, timeout=20) as http:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert set(_series((await http.get("/metrics")).text, decode.id)) == {"remote"}
            prefill.mode = "no_params"  # the prefill pool fails: the decode worker prefills locally
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert set(_series((await http.get("/metrics")).text, decode.id)) == {"local", "remote"}
    finally:
        await c.stop()
