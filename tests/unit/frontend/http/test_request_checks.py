"""API keys, the rate limiter and the OpenAPI document, without processes (the doors themselves
are driven through a real frontend in tests/integration/frontend/test_frontend_security.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dynamod.daemon.frontend.http.auth import ApiKeys, bearer_key
from dynamod.daemon.frontend.http.limits import RateLimiter, declared_length
from dynamod.daemon.frontend.openai.openapi import build_document
from dynamod.shared.errors import ConfigError

KEY_A = "a" * 20
KEY_B = "b" * 20


def test_keys_identify_only_accepted_keys_and_never_show_them(tmp_path: Path) -> None:
    keys = ApiKeys([KEY_A, KEY_B])
    assert keys.identify(KEY_A.encode()) and keys.identify(KEY_B.encode())
    assert keys.identify(KEY_A.encode()) != keys.identify(KEY_B.encode())
    for wrong in (None, b"", b"a" * 19, b"a" * 21, KEY_A.upper().encode()):
        assert keys.identify(wrong) is None
    assert KEY_A not in repr(keys) and KEY_A not in (keys.identify(KEY_A.encode()) or "")
    with pytest.raises(ConfigError, match="at least 16"):
        ApiKeys(["short"])
    assert ApiKeys.from_sources(None, None) is None and ApiKeys.from_sources(None, " , ") is None
    assert len(ApiKeys.from_sources(None, f"{KEY_A},{KEY_B}")) == 2  # type: ignore[arg-type]


def test_keys_file_is_reloaded_and_a_broken_one_keeps_the_old_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# comment\n{KEY_A}\n")
    keys = ApiKeys(file=str(path))
    assert keys.identify(KEY_A.encode()) and not keys.identify(KEY_B.encode())
    path.write_text(f"{KEY_B}\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on coarse clocks
    keys._next_check = 0.0  # the once-a-second check is due
    assert keys.identify(KEY_B.encode()) and not keys.identify(KEY_A.encode())
    path.write_text("short\n")
    assert not keys.reload() and keys.identify(KEY_B.encode())  # kept
    path.write_text("\n")
    assert not keys.reload() and keys.identify(KEY_B.encode())
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        ApiKeys(file=str(empty))


def test_bearer_key_parsing() -> None:
    assert bearer_key(b"Bearer abc") == b"abc" and bearer_key(b"bearer   abc ") == b"abc"
    assert bearer_key(b"Basic abc") is None and bearer_key(b"Bearer ") is None and bearer_key(None) is None


def test_rate_limiter_buckets_per_client() -> None:
    limiter = RateLimiter(2.0, 3.0)
    assert [limiter.acquire("a", now=10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.acquire("a", now=10.0)
    assert wait == pytest.approx(0.5)
    assert limiter.acquire("b", now=10.0) == 0.0  # its own bucket
    assert limiter.acquire("a", now=10.5) == 0.0  # one token back after 1/rate
    assert limiter.acquire("a", now=10.5) > 0.0
    assert limiter.acquire("a", now=100.0) == 0.0  # refilled, capped at the burst
    assert [limiter.acquire("a", now=100.0) for _ in range(2)] == [0.0, 0.0]
    assert limiter.acquire("a", now=100.0) > 0.0
    with pytest.raises(ConfigError):
        RateLimiter(0.0)


def test_rate_limiter_table_is_bounded() -> None:
    limiter = RateLimiter(1.0, 1.0, max_clients=100)
    for i in range(1000):
        limiter.acquire(f"client-{i}", now=float(i) / 1000)
    assert len(limiter) <= 100
    assert limiter.acquire("client-999", now=0.999) > 0.0  # recent clients keep their bucket


def test_declared_length() -> None:
    assert declared_length([(b"host", b"x"), (b"content-length", b"42")]) == 42
    assert declared_length([(b"transfer-encoding", b"chunked")]) is None


def test_openapi_document_lists_routes_models_and_security() -> None:
    doc = build_document({"chat": ["tiny", "big"], "embedding": []}, api_keys=True)
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/health"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["enum"] == ["big", "tiny"]
    assert "enum" not in schemas["EmbeddingRequest"]["properties"]["model"]
    assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["minimum"] == 1
    assert doc["security"] == [{"bearerAuth": []}] and doc["paths"]["/live"]["get"]["security"] == []
    open_doc = build_document({}, api_keys=False)
    assert "security" not in open_doc and "enum" not in open_doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
