"""Session affinity with real processes: a frontend in round-robin mode and three mocker workers.

Twelve requests of one session (``x-dynamo-session-id``, or ``nvext.session_control`` in the body,
on chat, completions and ``/v1/messages``) land on one worker while requests without a session
still take turns over all three. When that worker drains (its ``drain`` control endpoint, as
``dynamoctl drain`` calls it), the session moves once to another worker and stays there, and the
route explanation and the metrics say so.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import (
    LocalCluster,
    get_text,
    running_cluster,
    worker_control,
)

pytestmark = pytest.mark.timeout(120)

SESSION = "agent-7f3a"
HEADERS = {"x-dynamo-session-id": SESSION, "x-dynamo-route-explain": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("sessions"), workers=3) as c:
        yield c



def _served(raw: openai.APIResponse) -> tuple[str, dict]:  # type: ignore[type-arg]
    return raw.headers["x-dynamo-worker-instance-id"], json.loads(raw.headers["x-dynamo-route-explain"])["session"]


def _counter(text: str, outcome: str) -> float:
    m = re.search(rf'dynamo_router_sessions_total\{{outcome="{outcome}"\}} ([0-9.]+)', text)
    return float(m.group(1)) if m else 0.0


def test_session_sticks_then_moves_once_when_its_worker_drains(cluster: LocalCluster) -> None:
    api = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)
    chat = [{"role": "user", "content": "turn"}]

    # Without a session, round-robin takes turns over all three workers.
    plain = {api.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
             .headers["x-dynamo-worker-instance-id"] for _ in range(3)}
    assert len(plain) == 3

    # Twelve requests of one session, by header and by nvext, through chat, completions and messages.
    served, sessions = [], []
    for i in range(10):
        if i % 2:
            raw = api.chat.completions.with_raw_response.create(model="tiny", messages=chat, max_tokens=2, extra_headers=HEADERS)
        else:
            raw = api.completions.with_raw_response.create(model="tiny", prompt=f"turn {i}", max_tokens=2, extra_headers=HEADERS)
        worker, info = _served(raw)
        served.append(worker)
        sessions.append(info)
    raw = api.chat.completions.with_raw_response.create(
        model="tiny", messages=chat, max_tokens=2, extra_headers={"x-dynamo-route-explain": "1"},
        extra_body={"nvext": {"session_control": {"session_id": SESSION}}},
    )
    served.append(_served(raw)[0])
    messages = httpx.post(
        cluster.url + "/v1/messages", headers={"x-dynamo-session-id": SESSION}, timeout=30,
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "turn"}]},
    )
    assert messages.status_code == 200, messages.text
    served.append(messages.headers["x-dynamo-worker-instance-id"])
    assert len(set(served)) == 1, served
    home = served[0]
    assert sessions[0]["outcome"] in ("new", "kept")  # "kept" if a previous run's binding is still alive
    assert all(s["outcome"] == "kept" and s["worker_id"] == home for s in sessions[1:])

    # Requests without a session still go round over all three meanwhile.
    plain = {api.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
             .headers["x-dynamo-worker-instance-id"] for _ in range(3)}
    assert len(plain) == 3

    asyncio.run(worker_control(cluster, "drain", home, {"wait": False}))
    try:
        wait_until(lambda: home not in cluster.ready_workers() and len(cluster.ready_workers()) == 2, 10,
                   what="the drained worker to leave the ready set")
        after = [_served(api.completions.with_raw_response.create(
            model="tiny", prompt=f"after {i}", max_tokens=2, extra_headers=HEADERS)) for i in range(6)]
        moved_to = after[0][0]
        assert moved_to != home
        assert after[0][1]["outcome"] == "moved" and after[0][1]["reason"] == "draining"
        assert after[0][1]["held_worker_id"] == home
        assert all(w == moved_to and s["outcome"] == "kept" for w, s in after[1:])
        # Without a session, the two ready workers share the load.
        plain = {api.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
                 .headers["x-dynamo-worker-instance-id"] for _ in range(4)}
        assert plain == set(cluster.ready_workers())
    finally:
        asyncio.run(worker_control(cluster, "wake_up", home, {}))
        wait_until(lambda: len(cluster.ready_workers()) == 3, 10, what="the worker to be ready again")

    # Its old worker is back; the session stays where it moved.
    raw = api.completions.with_raw_response.create(model="tiny", prompt="back", max_tokens=2, extra_headers=HEADERS)
    assert _served(raw)[0] == moved_to
    metrics = get_text(cluster.url + "/metrics")
    assert _counter(metrics, "moved") == 1
    assert _counter(metrics, "kept") >= 17


def test_a_second_frontend_routes_the_session_to_the_same_worker(cluster: LocalCluster) -> None:
    """Bindings travel between frontends on the event plane (``session_affinity_events``)."""
    first_url, first_proc, first_port = cluster.url, cluster.frontend, cluster.http_port
    second = cluster.start_frontend()
    second_url = cluster.url
    cluster.frontend, cluster.http_port = first_proc, first_port  # the fixture stops the first
    try:
        wait_until(lambda: len(get_json_or_none(second_url + "/health")) == 3, 30, what="the second frontend's workers")
        one = openai.OpenAI(base_url=first_url + "/v1", api_key="none", max_retries=0, timeout=30)
        two = openai.OpenAI(base_url=second_url + "/v1", api_key="none", max_retries=0, timeout=30)
        attempt = iter(range(1000))

        def bound_on_first_is_kept_on_second() -> bool:
            # A fresh session each try: until the second frontend's subscription is connected it
            # routes the session as new (and binds its own), which is never reported as kept.
            headers = {"x-dynamo-session-id": f"shared-{next(attempt)}", "x-dynamo-route-explain": "1"}
            worker = one.completions.with_raw_response.create(
                model="tiny", prompt="a", max_tokens=2, extra_headers=headers).headers["x-dynamo-worker-instance-id"]
            return _kept_on(two, headers, worker)

        wait_until(bound_on_first_is_kept_on_second, 20, what="a session bound on one frontend kept on the other")
    finally:
        second.stop()


def _kept_on(api: openai.OpenAI, headers: dict, worker: str) -> bool:
    raw = api.completions.with_raw_response.create(model="tiny", prompt="b", max_tokens=2, extra_headers=headers)
    served, info = _served(raw)
    return served == worker and info["outcome"] == "kept"


def get_json_or_none(url: str) -> list:
    try:
        body = json.loads(httpx.get(url, timeout=5).text)
    except (httpx.HTTPError, ValueError):
        return []
    return [w for m in body.get("models", []) if m["model"] == "tiny" for w in m["workers"] if w["status"] == "ready"]
