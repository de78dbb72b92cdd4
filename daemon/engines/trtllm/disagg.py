"""Prefill/decode disaggregation on TensorRT-LLM: context-only and generation-only requests.

TensorRT-LLM splits a request with ``tensorrt_llm.llmapi.DisaggregatedParams``: the context
(prefill) engine runs it with ``request_type="context_only"`` and returns, on the output's
``disaggregated_params``, what the generation engine needs to fetch the KV through its cache
transceiver (``ctx_request_id``, ``first_gen_tokens``, ``opaque_state`` bytes, ``draft_tokens``
and, in newer releases, fields such as ``disagg_request_id`` or ``ctx_dp_rank``); the generation
(decode) engine gets the same fields back with ``request_type="generation_only"``. Both engines
need ``cache_transceiver_config`` in their ``LLM()`` arguments; context engines also run without
the overlap scheduler, as TensorRT-LLM's disaggregated examples configure them.

Between the two the fields travel as a JSON-safe dict (``bytes`` as tagged base64,
common/disagg.py), field by field, so a release that adds fields passes them through and a
generation engine of an older release drops the ones its ``DisaggregatedParams`` lacks (with a
warning) instead of failing the request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from dynamod.daemon.engines.common.disagg import ROLE_AGG, ROLE_PREFILL, from_json_safe, to_json_safe
from dynamod.shared.errors import InvalidRequestError

logger = logging.getLogger(__name__)

CONTEXT_ONLY = "context_only"
GENERATION_ONLY = "generation_only"
DEFAULT_CACHE_TRANSCEIVER = {"backend": "DEFAULT"}


def disaggregation_options(options: dict[str, Any], role: str) -> dict[str, Any]:
    """``LLM()`` arguments for ``role``, the operator's own taking precedence."""
    if role == ROLE_AGG:
        return options
    out = dict(options)
    out.setdefault("cache_transceiver_config", dict(DEFAULT_CACHE_TRANSCEIVER))
    if role == ROLE_PREFILL:
        out.setdefault("disable_overlap_scheduler", True)
    return out


def _fields(params: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return {k: v for k, v in vars(params).items() if not k.startswith("_")}


def encode_params(params: Any) -> dict[str, Any]:
    """A context-only output's ``DisaggregatedParams`` as a JSON-safe dict (``request_type`` and
    unset fields left out; a field JSON cannot hold is dropped with a warning)."""
    out: dict[str, Any] = {}
    for name, value in _fields(params).items():
        if value is None or name == "request_type":
            continue
        try:
            out[name] = to_json_safe(value)
        except TypeError as exc:
            logger.warning("trtllm disaggregated param dropped field=%s reason=%s", name, exc)
    return out


def decode_params(params: Mapping[str, Any], params_cls: Any) -> Any:
    """The generation-only ``DisaggregatedParams`` for a decode leg, from ``encode_params``' dict."""
    if params.get("ctx_request_id") is None and params.get("disagg_request_id") is None:
        keys = ", ".join(sorted(params)) or "none"
        raise InvalidRequestError(
            f"disaggregated_params are not TensorRT-LLM context results from a TensorRT-LLM prefill worker "
            f"(no ctx_request_id; keys: {keys}); prefill and decode pools must run the same engine"
        )
    known = {f.name for f in dataclasses.fields(params_cls)} if dataclasses.is_dataclass(params_cls) else None
    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        if name == "request_type":
            continue
        if known is not None and name not in known:
            logger.warning("trtllm disaggregated param unknown to this release dropped field=%s", name)
            continue
        kwargs[name] = from_json_safe(value)
    try:
        return params_cls(request_type=GENERATION_ONLY, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"TensorRT-LLM refused the disaggregated params: {exc}") from None
