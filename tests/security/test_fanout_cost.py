"""The cost rules behind the fan-out caps (issue 25, item 3), without processes: the bucket takes a
request's whole cost, a cost above the burst leaves debt, and admission counts generations."""

from __future__ import annotations

import pytest

from dynamod.daemon.frontend.http.limits import RATE_LIMIT_SCOPE_KEY, RateLimiter
from dynamod.daemon.frontend.openai.fanout import check_fanout, fanout_cost
from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest, CompletionRequest
from dynamod.daemon.frontend.pipeline.state import FrontendConfig, FrontendState
from dynamod.shared.errors import InvalidRequestError, OverloadedError, RateLimitedError


def test_a_bucket_takes_the_whole_cost_and_big_costs_leave_debt() -> None:
    limiter = RateLimiter(1.0, 20.0)
    assert limiter.acquire("a", now=0.0, cost=16) == 0.0
    assert limiter.acquire("a", now=0.0, cost=16) == pytest.approx(12.0)  # 4 left, 16 needed
    assert limiter.acquire("a", now=0.0) == 0.0
    assert limiter.acquire("b", now=0.0, cost=50) == 0.0  # a full bucket pays for more than its burst...
    assert limiter.acquire("b", now=0.0) == pytest.approx(31.0)  # ...and the debt is paid at the rate
    assert limiter.waiting("b", now=31.0) == 0.0


def _state(max_inflight: int = 64, max_prompts: int = 16) -> FrontendState:
    config = FrontendConfig(max_inflight=max_inflight, max_prompts_per_request=max_prompts)
    return FrontendState(config=config, registry=None, dispatcher=None, metrics=None)  # type: ignore[arg-type]


def test_check_fanout_caps_charges_and_admits_by_generations() -> None:
    batch = CompletionRequest(model="m", prompt=["a"] * 4, n=4)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert fanout_cost(batch) == 16 and fanout_cost(chat) == 1
    state = _state()
    with pytest.raises(InvalidRequestError, match="20 generations"):
        check_fanout({}, CompletionRequest(model="m", prompt=["a"] * 4, n=5), state)
    limiter = RateLimiter(1.0, 20.0)
    limiter.acquire("k", now=None)  # the doors' token
    scope = {RATE_LIMIT_SCOPE_KEY: (limiter, "k")}
    assert check_fanout(scope, batch, state) == 16
    with pytest.raises(RateLimitedError, match="costs 16"):
        check_fanout(scope, batch, state)
    state.admit(60)
    with pytest.raises(OverloadedError, match="needs 16"):
        check_fanout({}, batch, state)
    assert check_fanout({}, chat, state) == 1
