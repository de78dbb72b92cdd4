"""Per-worker series leave with their worker (issue 25, item 10), with real processes.

Two mocker workers behind a frontend both answer requests; one is killed; once its lease ran out
the frontend's ``/metrics`` no longer exports its ``worker_id`` series, so worker churn cannot grow
the series without bound.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import get_text, running_cluster
from tests.security.frontend_abuse_support import request

pytestmark = pytest.mark.timeout(90)

SERIES = re.compile(r'^dynamo_frontend_worker_last_time_to_first_token_seconds\{[^}]*\bworker_id="([0-9a-f]+)"', re.M)


def _series(url: str) -> set[str]:
    return set(SERIES.findall(get_text(url + "/metrics")))


def test_a_departed_workers_series_are_removed(tmp_path: Path) -> None:
    with running_cluster(tmp_path, workers=2, lease_ttl=2.0, speedup=50.0) as cluster:
        def both_answered() -> bool:
            assert request(cluster, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2},
                           key=None)[0] == 200
            return len(_series(cluster.url)) == 2

        wait_until(both_answered, 30, interval=0.05, what="both workers to answer")
        before = _series(cluster.url)
        victim = cluster.workers[0]
        victim_hex = next(i for i in before if int(i, 16) and cluster.instance_pid(i) == victim.pid)
        victim.kill9()
        wait_until(lambda: victim_hex not in _series(cluster.url), 20, interval=0.1, what="the dead worker's series to go")
        assert _series(cluster.url) == before - {victim_hex}
