"""Schema fuzzing: Schemathesis generates requests from the frontend's own ``/openapi.json`` (valid
and, with negative data, invalid ones) against a real frontend in front of a real mocker worker,
and no answer may be a 5xx (``not_a_server_error``).

Bounded: ``EXAMPLES`` cases per operation, derandomized (the same cases every run, so a failure
reproduces), no shrinking (a failing case is reported as generated, with its curl command).
"""

from __future__ import annotations

from collections.abc import Iterator

import hypothesis
import pytest

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from tests.integration.test_frontend_support import LocalCluster, running_cluster  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EXAMPLES = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # A fast mocker: generated max_tokens run to the context length in a blink.
    with running_cluster(tmp_path_factory.mktemp("schemathesis"), workers=1, speedup=1000.0) as c:
        yield c


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_operation_answers_5xx(cluster: LocalCluster, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    schema.config.generation.update(modes=[mode])
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions", "GET /health"}
    failures: list[str] = []

    for operation in operations:
        try:
            _fuzz(operation, cluster.url, failures)
        except Exception:  # noqa: BLE001 - recorded in failures; go on with the other operations
            if not failures or not failures[-1].startswith(operation.label):
                raise

    assert not failures, "\n\n".join(failures)


def _fuzz(operation: schemathesis.APIOperation, base_url: str, failures: list[str]) -> None:
    """``EXAMPLES`` generated cases of ``operation``; a 5xx is recorded in ``failures`` and raised."""

    @hypothesis.settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy())
    def run(case: schemathesis.Case) -> None:
        try:
            case.call_and_validate(base_url=base_url, checks=[not_a_server_error], timeout=30)
        except AssertionError as exc:  # schemathesis' failure groups are AssertionErrors
            failures.append(f"{operation.label}: {exc}")
            raise

    run()
