"""Anthropic-shaped errors: the body, the type for each status, the headers; and the key a
request presents (``Authorization: Bearer`` or ``x-api-key``)."""

from __future__ import annotations

import json

import msgspec

from dynamod.daemon.frontend.anthropic.errors import to_anthropic_error
from dynamod.daemon.frontend.app import door_error
from dynamod.daemon.frontend.http.auth import presented_key
from dynamod.shared.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidApiKeyError,
    NotFoundError,
    OverloadedError,
    RateLimitedError,
)


def _body(exc: BaseException) -> tuple[int, dict, dict]:
    error = to_anthropic_error(exc, request_id="abc")
    return error.status, json.loads(error.body), dict(error.headers)


def test_each_status_gets_anthropics_error_type() -> None:
    cases = [
        (ContextLengthError("too long", param="max_tokens"), 400, "invalid_request_error"),
        (InvalidApiKeyError("Incorrect API key provided."), 401, "authentication_error"),
        (NotFoundError("no such model"), 404, "not_found_error"),
        (RateLimitedError("slow down", retry_after_s=2.5), 429, "rate_limit_error"),
        (OverloadedError("at --max-inflight", retry_after_s=1.0), 503, "overloaded_error"),
        (DeadlineExceededError("too slow"), 504, "timeout_error"),
        (msgspec.ValidationError("Expected `int`"), 400, "invalid_request_error"),  # a foreign error, mapped
    ]
    for exc, status, kind in cases:
        got_status, body, headers = _body(exc)
        assert got_status == status, exc
        assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
        assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
        assert body["request_id"] == "req_abc" and headers[b"request-id"] == b"req_abc"
    assert _body(ContextLengthError("too long", param="max_tokens"))[1]["error"]["message"] == "max_tokens: too long"
    assert _body(RateLimitedError("x", retry_after_s=2.5))[2][b"retry-after"] == b"3"


def test_a_bug_is_an_api_error_without_the_traceback() -> None:
    status, body, _ = _body(KeyError("secret internals"))
    assert status == 500 and body["error"]["type"] == "api_error"
    assert "secret" not in body["error"]["message"] and "request_id=abc" in body["error"]["message"]


def test_door_refusals_take_the_shape_of_the_route() -> None:
    error = InvalidApiKeyError("Incorrect API key provided.")
    anthropic_body = json.loads(door_error({"path": "/v1/messages"}, error).body)
    assert anthropic_body["error"]["type"] == "authentication_error"
    assert json.loads(door_error({"path": "/v1/messages/count_tokens"}, error).body)["type"] == "error"
    openai_body = json.loads(door_error({"path": "/v1/chat/completions"}, error).body)
    assert openai_body["error"]["code"] == "invalid_api_key" and "type" not in openai_body


def test_presented_key_takes_bearer_or_x_api_key() -> None:
    assert presented_key([(b"authorization", b"Bearer k1")]) == b"k1"
    assert presented_key([(b"x-api-key", b" k2 ")]) == b"k2"
    assert presented_key([(b"x-api-key", b"k2"), (b"authorization", b"Bearer k1")]) == b"k1"  # bearer first
    assert presented_key([(b"authorization", b"Basic zzz"), (b"x-api-key", b"k2")]) == b"k2"
    assert presented_key([(b"x-api-key", b"")]) is None and presented_key([]) is None
