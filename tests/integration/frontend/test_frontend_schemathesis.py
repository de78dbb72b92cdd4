"""Schema fuzzing: Schemathesis generates requests from the frontend's own ``/openapi.json`` (valid
and, with negative data, invalid ones) against a real frontend in front of a real mocker worker,
and no answer may be a 5xx (``not_a_server_error``).

A fuzzer whose requests are all refused with 400 proves nothing about what lies behind the
validation, so the test also shows that it gets there:

- in positive mode, at least ``MIN_SERVED_SHARE`` of the generated requests to the generation
  routes of a served model, and ``MIN_ROUTE_SHARE`` of each route's, are answered 2xx (the
  distribution is printed): a schema or generator regression that mostly produces refusals fails;
- with a fault planted behind the validation (a proxy in front of the frontend turns a served chat
  completion into a 500, as a bug in formatting one would), the same run must report that 500.

Schemathesis spells integers as ``2.0`` in JSON bodies, since OpenAPI 3.1 says ``2.0`` is the
integer 2. The frontend, like OpenAI's API and Dynamo's, refuses a decimal where an integer is due,
which JSON Schema cannot express; positive cases are therefore sent with whole numbers spelled as
integers (``whole_numbers``), so that they are the valid requests they were generated as.

Bounded: ``EXAMPLES`` cases per operation, derandomized (the same cases every run, so a failure
reproduces), no shrinking (a failing case is reported as generated, with its curl command).
"""

from __future__ import annotations

import collections
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from tests.fixtures.openapi import whole_numbers  # noqa: E402
from tests.fixtures.servers import wait_until  # noqa: E402
from tests.integration.frontend.test_frontend_support import LocalCluster, running_cluster  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EXAMPLES = 20
MIN_SERVED_SHARE = 0.5  # 70% with this schema; 15% before its Any fields were spelled out
# Per route, enough to show the generator gets past validation at all (a route answered only 400s
# fails): Responses' random previous_response_id and non-JSON function arguments refuse most of its
# cases, and how many depends on the schemathesis/hypothesis versions (7/20 here, 4/20 in CI).
MIN_ROUTE_SHARE = 0.1
SERVED_GENERATION = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses")
"""The generation routes whose ``model`` enum lists a served model (no embedding model is served:
every embeddings request is a 404, rightly)."""

Statuses = dict[str, collections.Counter[int]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # A fast mocker: generated max_tokens run to the context length in a blink.
    with running_cluster(tmp_path_factory.mktemp("schemathesis"), workers=1, speedup=1000.0) as c:
        # The document bounds token ids by the vocabulary once the model's tokenizer is loaded
        # (in the background): fuzz the complete document, the same every run.
        wait_until(lambda: _token_id_bound(c.url) is not None, 30, what="the tokenizer's bounds in /openapi.json")
        yield c


def _token_id_bound(url: str) -> int | None:
    doc = httpx.get(url + "/openapi.json", timeout=5).json()
    ids = doc["components"]["schemas"]["CompletionRequest"]["properties"]["allowed_token_ids"]["anyOf"][0]
    bound = ids["items"]["maximum"]
    return bound if bound < 2**31 - 1 else None


def _operations(base_url: str, mode: GenerationMode, schema_url: str | None = None) -> list[Any]:
    schema = schemathesis.openapi.from_url(schema_url or base_url + "/openapi.json")
    schema.config.generation.update(modes=[mode])
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(
    operation: Any, base_url: str, mode: GenerationMode, failures: list[str], statuses: Statuses
) -> None:
    """``EXAMPLES`` generated cases of ``operation``; a 5xx is recorded in ``failures`` and raised."""

    @hypothesis.settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy())
    def run(case: schemathesis.Case) -> None:
        if mode is GenerationMode.POSITIVE and case.body is not None:
            case.body = whole_numbers(case.body)
        response = case.call(base_url=base_url, timeout=30)
        statuses[operation.label][response.status_code] += 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except (AssertionError, FailureGroup) as exc:  # one failure, or a group (a BaseExceptionGroup)
            failures.append(f"{operation.label}: {exc}")
            raise

    run()


def _fuzz_all(operations: list[Any], base_url: str, mode: GenerationMode) -> tuple[list[str], Statuses]:
    failures: list[str] = []
    statuses: Statuses = collections.defaultdict(collections.Counter)
    for operation in operations:
        try:
            _fuzz(operation, base_url, mode, failures, statuses)
        except (Exception, FailureGroup):  # noqa: BLE001 - recorded in failures; go on with the other operations
            if not failures or not failures[-1].startswith(operation.label):
                raise
    print(f"status distribution ({mode.value}):", json.dumps({k: dict(v) for k, v in sorted(statuses.items())}))
    return failures, statuses


def served_share(statuses: Statuses, labels: tuple[str, ...] = SERVED_GENERATION) -> float:
    """The share of 2xx answers over ``labels`` (the generation routes of a served model)."""
    counts = [statuses.get(label, collections.Counter()) for label in labels]
    total = sum(sum(c.values()) for c in counts)
    ok = sum(n for c in counts for status, n in c.items() if 200 <= status < 300)
    return ok / total if total else 0.0


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_operation_answers_5xx(cluster: LocalCluster, mode: GenerationMode) -> None:
    operations = _operations(cluster.url, mode)
    assert {op.label for op in operations} >= {*SERVED_GENERATION, "GET /health"}
    failures, statuses = _fuzz_all(operations, cluster.url, mode)
    assert not failures, "\n\n".join(failures)
    if mode is GenerationMode.POSITIVE:
        share = served_share(statuses)
        assert share >= MIN_SERVED_SHARE, (
            f"only {share:.0%} of the generated requests to served models were answered 2xx (want at least "
            f"{MIN_SERVED_SHARE:.0%}): the schema no longer describes what the frontend serves"
        )
        for label in SERVED_GENERATION:  # and each route on its own reaches the worker
            assert served_share({label: statuses[label]}, (label,)) >= MIN_ROUTE_SHARE, (label, dict(statuses[label]))


# -- a fault behind the validation ----------------------------------------------------------------


class _FaultyFrontend(http.server.ThreadingHTTPServer):
    """Forwards to the frontend and answers 500 instead of any chat completion it served: a fault
    that only a request valid enough to be served can reach (a refused one is passed through)."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ForwardHandler)
        self.upstream = httpx.Client(base_url=upstream, timeout=30)
        self.planted = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ForwardHandler(http.server.BaseHTTPRequestHandler):
    server: _FaultyFrontend

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization", "accept")}
        reply = self.server.upstream.request(self.command, self.path, content=body, headers=headers)
        status, content, ctype = reply.status_code, reply.content, reply.headers.get("content-type", "")
        if self.command == "POST" and self.path.startswith("/v1/chat/completions") and 200 <= status < 300:
            self.server.planted += 1
            status, ctype = 500, "application/json"
            content = b'{"error": {"message": "planted fault: formatting a served chat completion failed", ' \
                      b'"type": "internal_server_error", "param": null, "code": "internal_error"}}'
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = do_DELETE = _forward

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        return None


@pytest.fixture
def faulty(cluster: LocalCluster) -> Iterator[_FaultyFrontend]:
    server = _FaultyFrontend(cluster.url)
    thread = threading.Thread(target=server.serve_forever, name="faulty-frontend", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        server.upstream.close()
        thread.join(5)


def test_a_fault_behind_the_validation_is_reported(faulty: _FaultyFrontend) -> None:
    operations = [op for op in _operations(faulty.url, GenerationMode.POSITIVE)
                  if op.label == "POST /v1/chat/completions"]
    failures, statuses = _fuzz_all(operations, faulty.url, GenerationMode.POSITIVE)
    assert faulty.planted > 0, f"no generated request was valid enough to be served: {dict(statuses)}"
    assert failures and all(f.startswith("POST /v1/chat/completions") for f in failures)
    assert "planted fault" in failures[0] and "Server error" in failures[0], failures[0]
