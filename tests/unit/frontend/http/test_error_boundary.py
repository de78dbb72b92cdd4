"""The frontend's error boundary (httpx's ``test_httpcore_all_exceptions_mapped`` is the model).

Two promises a client relies on: every ``DynamoError`` class, wherever it is defined, reaches the
client with its own class's status and an OpenAI error body; and no foreign exception (msgspec,
bytes that are not UTF-8, a library's ``ValueError``, a timeout, a dropped connection, a bug) leaks
out of a handler as anything but such a body: never a traceback, never uvicorn's plain-text 500.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from dynamod.daemon.frontend import app as frontend_app
from dynamod.daemon.frontend.http.errors import FOREIGN_ERRORS, to_http_error
from dynamod.daemon.frontend.pipeline.generation import TextGeneration
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.shared.errors import DynamoError, RemoteError, error_from_wire, error_to_wire
from tests.unit.frontend.test_app import Cluster

LAYERS = ("shared", "daemon", "console")
ERROR_KEYS = {"message", "type", "param", "code"}
TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                  413: "invalid_request_error", 429: "rate_limit_error",
                  500: "internal_server_error", 502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}


# ---- the tree ---------------------------------------------------------------------------------


def _module_trees() -> dict[str, ast.Module]:
    trees = {}
    for layer in LAYERS:
        root = Path(importlib.import_module(f"dynamod.{layer}").__path__[0])
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            trees[".".join(("dynamod", layer, *parts))] = ast.parse(path.read_text(), str(path))
    return trees


def _error_classes_in_source() -> dict[str, set[str]]:
    """Module -> names of its top-level classes that derive (by name, transitively) from
    DynamoError. Read from the source, so a new module with a new subclass is found unasked."""
    trees = _module_trees()
    names = {"DynamoError"}
    found: dict[str, set[str]] = {}
    grew = True
    while grew:
        grew = False
        for module, tree in trees.items():
            for node in tree.body:
                if not isinstance(node, ast.ClassDef) or node.name in found.get(module, ()):
                    continue
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases}
                if bases & names:
                    found.setdefault(module, set()).add(node.name)
                    names.add(node.name)
                    grew = True
    return found


def _walk(cls: type[DynamoError]) -> set[type[DynamoError]]:
    out = {cls}
    for sub in cls.__subclasses__():
        out |= _walk(sub)
    return out


def _dynamod_error_tree() -> list[type[DynamoError]]:
    """Every DynamoError class defined in dynamod, after importing every module that defines one."""
    expected = set()
    for module_name, class_names in _error_classes_in_source().items():
        module = importlib.import_module(module_name)
        for name in class_names:
            cls = getattr(module, name)
            if issubclass(cls, DynamoError):  # not a namesake from another library
                expected.add(cls)
    tree = {c for c in _walk(DynamoError) if c.__module__.startswith("dynamod.")}
    missing = expected - tree
    assert not missing, f"classes found in the source but not in the tree: {missing}"
    return sorted(tree, key=lambda c: (c.__module__, c.__qualname__))


ERROR_TREE = _dynamod_error_tree()


def _instance(cls: type[DynamoError]) -> DynamoError:
    """One instance, whatever the constructor asks for (``PrefillFailed(reason, message)``...)."""
    params = [
        p for p in inspect.signature(cls).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return cls(*[f"boom {p.name}" for p in params])


def _assert_openai_body(body: bytes, status: int) -> dict[str, Any]:
    text = body.decode()
    assert "Traceback" not in text
    detail = json.loads(text)["error"]
    assert set(detail) == ERROR_KEYS
    assert detail["type"] == TYPE_BY_STATUS[status] and detail["message"] and detail["code"]
    return detail


def test_the_tree_holds_the_subclasses_defined_outside_shared_errors() -> None:
    names = {c.__qualname__ for c in ERROR_TREE}
    assert {"KvTransferError", "KvTransferTimeout", "BodyTooLargeError", "WorkerAborted", "PrefillFailed"} <= names


def test_codes_name_one_class_each() -> None:
    owners: dict[str, type[DynamoError]] = {}
    for cls in ERROR_TREE:
        if "code" in cls.__dict__:
            assert cls.code not in owners, f"{cls.__qualname__} reuses the code of {owners[cls.code].__qualname__}"
            owners[cls.code] = cls


@pytest.mark.parametrize("cls", ERROR_TREE, ids=lambda c: c.__qualname__)
def test_every_dynamo_error_maps_to_its_class_status(cls: type[DynamoError]) -> None:
    exc = _instance(cls)
    if cls is not RemoteError:  # a relayed error carries the remote status instead
        assert exc.http_status == cls.http_status
    error = to_http_error(exc, request_id="r1")
    assert error.status == exc.http_status and 400 <= error.status < 600
    detail = _assert_openai_body(error.body, error.status)
    assert detail["code"] in (exc.public_code, "model_not_found")
    assert detail["message"] == str(exc)
    assert any(k == b"retry-after" for k, _ in error.headers) == (error.status in (429, 503))


@pytest.mark.parametrize("cls", ERROR_TREE, ids=lambda c: c.__qualname__)
def test_status_and_code_survive_the_request_plane(cls: type[DynamoError]) -> None:
    exc = _instance(cls)
    rebuilt = error_from_wire(error_to_wire(exc))
    assert rebuilt.http_status == exc.http_status and rebuilt.public_code == exc.public_code


def test_a_subclass_defined_after_shared_errors_comes_back_as_itself() -> None:
    from dynamod.shared.kv.transfer.base import KvTransferTimeout

    rebuilt = error_from_wire(error_to_wire(KvTransferTimeout("peer stalled")))
    assert type(rebuilt) is KvTransferTimeout and rebuilt.http_status == 504


# ---- foreign exceptions, one by one -------------------------------------------------------------


@pytest.mark.parametrize("foreign", list(FOREIGN_ERRORS), ids=lambda c: c.__name__)
def test_every_foreign_class_maps_to_its_entry(foreign: type[BaseException]) -> None:
    ours, _ = FOREIGN_ERRORS[foreign]
    error = to_http_error(foreign("detail"))
    assert error.status == ours.http_status
    assert _assert_openai_body(error.body, error.status)["code"] == ours.code


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 400, "invalid_request_error"),
        (json.JSONDecodeError("Expecting value", "x", 0), 400, "invalid_request_error"),
        (msgspec.ValidationError("Expected `int`, got `str` - at `$.max_tokens`"), 400, "invalid_request_error"),
        (TimeoutError(), 504, "deadline_exceeded"),
        (ConnectionResetError(104, "Connection reset by peer"), 502, "transport_error"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_the_most_specific_foreign_entry_wins(exc: BaseException, status: int, code: str) -> None:
    error = to_http_error(exc)
    assert error.status == status
    assert _assert_openai_body(error.body, status)["code"] == code


@pytest.mark.parametrize("bug", [KeyError("secret"), RuntimeError("secret"), AttributeError("secret")], ids=repr)
def test_a_bug_is_a_500_that_shows_no_detail(bug: Exception) -> None:
    error = to_http_error(bug, request_id="req-7")
    assert error.status == 500
    detail = _assert_openai_body(error.body, 500)
    assert "secret" not in detail["message"] and "req-7" in detail["message"]


# ---- the handlers, driven in-process ------------------------------------------------------------


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    await c.start()
    try:
        await c.add_worker()
        yield c
    finally:
        await c.stop()


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _body(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra}


def _raiser(exc: BaseException) -> Callable[..., Any]:
    def raise_it(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return raise_it


async def _assert_error_response(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    assert _assert_openai_body(resp.content, status)["code"] == code


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_body_that_is_not_utf8_is_a_400(cluster: Cluster, path: str) -> None:
    """msgspec raises ``UnicodeDecodeError`` (not its own error) for such bytes."""
    body = json.dumps(_body(path)).encode().replace(b'"hi"', b'"h\xff\xfei"')
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        await _assert_error_response(await raw.post(path, content=body), 400, "invalid_request_error")


FOREIGN_BEFORE_THE_RESPONSE = [
    # (where it is raised, what, status, code)
    ("tokenizer", ValueError("text too long for the tokenizer"), 400, "invalid_request_error"),
    ("tokenizer", RuntimeError("secret bug"), 500, "internal_error"),
    ("dispatch", TimeoutError(), 504, "deadline_exceeded"),
    ("dispatch", ConnectionRefusedError(111, "Connection refused"), 502, "transport_error"),
    ("dispatch", msgspec.ValidationError("Expected `str`"), 400, "invalid_request_error"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("where", "exc", "status", "code"), FOREIGN_BEFORE_THE_RESPONSE,
                         ids=[f"{w}-{type(e).__name__}" for w, e, _, _ in FOREIGN_BEFORE_THE_RESPONSE])
async def test_foreign_error_before_the_response_is_an_openai_error(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, path: str, where: str, exc: BaseException, status: int, code: str
) -> None:
    assert cluster.state is not None
    if where == "tokenizer":
        monkeypatch.setattr(ModelPreprocessor, "encode", _raiser(exc))
    else:
        monkeypatch.setattr(cluster.state.dispatcher, "open", _raiser(exc))
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        for stream in (False, True):
            resp = await raw.post(path, json=_body(path, stream=stream))
            await _assert_error_response(resp, status, code)
            assert "secret" not in resp.text
    assert cluster.state.inflight == 0


def _fail_after_first_delta(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    original = TextGeneration.__anext__
    served: dict[int, int] = {}

    async def anext(self: TextGeneration) -> Any:
        served[id(self)] = served.get(id(self), 0) + 1
        if served[id(self)] > 1:
            raise exc
        return await original(self)

    monkeypatch.setattr(TextGeneration, "__anext__", anext)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_foreign_error_after_the_first_token(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Unary: nothing is sent yet, so a proper status. Streaming: headers are out, so the error
    travels in-band as an OpenAI error event, and the stream still ends with [DONE]."""
    _fail_after_first_delta(monkeypatch, ConnectionResetError(104, "Connection reset by peer"))
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        await _assert_error_response(await raw.post(path, json=_body(path)), 502, "transport_error")
        resp = await raw.post(path, json=_body(path, stream=True))
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert _assert_openai_body(events[-2].encode(), 502)["code"] == "transport_error"


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [(TimeoutError(), 504, "deadline_exceeded"), (RuntimeError("secret bug"), 500, "internal_error")],
    ids=["TimeoutError", "RuntimeError"],
)
async def test_starlette_routes_use_the_same_boundary(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, exc: BaseException, status: int, code: str
) -> None:
    monkeypatch.setattr(frontend_app, "_model_object", _raiser(exc))
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        resp = await raw.get("/v1/models")
    await _assert_error_response(resp, status, code)
    assert "secret" not in resp.text
