"""The worker's own limits on a generate request (``check_generate_limits``), whoever sent it."""

from __future__ import annotations

import pytest

from dynamod.daemon.worker.service import check_generate_limits
from dynamod.shared.errors import ContextLengthError, InvalidRequestError, error_from_wire, error_to_wire
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions


def _req(prompt: int, max_tokens: int | None = None, min_tokens: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=[1] * prompt, stop=StopConditions(max_tokens=max_tokens, min_tokens=min_tokens)
    )


def test_requests_that_fit_pass() -> None:
    check_generate_limits(_req(10, 90), 100)
    check_generate_limits(_req(99), 100)
    check_generate_limits(_req(5000, 5000), 0)  # context unknown: only the ranges


@pytest.mark.parametrize(
    ("req", "error", "param"),
    [
        (_req(100), ContextLengthError, "messages"),
        (_req(10, 91), ContextLengthError, "max_tokens"),
        (_req(10, 0), InvalidRequestError, "max_tokens"),
        (_req(0, 5), InvalidRequestError, "prompt"),
        (_req(10, 5, 6), InvalidRequestError, "min_tokens"),
        (_req(10, 5, -1), InvalidRequestError, "min_tokens"),
    ],
)
def test_out_of_range_is_refused_with_a_400_class(req: PreprocessedRequest, error: type, param: str) -> None:
    with pytest.raises(error) as info:
        check_generate_limits(req, 100)
    assert info.value.param == param and info.value.http_status == 400
    # Over the request plane it stays the same class: a 400 at the frontend, never a migration.
    assert type(error_from_wire(error_to_wire(info.value))) is error
