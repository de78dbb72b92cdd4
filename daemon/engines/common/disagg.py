"""What the real-engine adapters share for prefill/decode disaggregation.

The frontend orchestrates (daemon/frontend): it sends a *prefill* request (``prefill_only=True``,
``max_tokens`` 1) to a worker started with ``--role prefill``, takes the first frame that carries
``disaggregated_params`` and passes that dict, unread, as the *decode* request's
``disaggregated_params`` to a ``--role decode`` worker. What the dict holds is each engine's own
business (vLLM's ``kv_transfer_params``, SGLang's bootstrap host/port/room, TensorRT-LLM's
``DisaggregatedParams``); the engine moves the KV itself through its own connector.

This module holds the parts that do not depend on the engine:

- ``worker_role``: the daemon's ``--role`` as the adapter sees it;
- ``request_stage``: what one request asks of this worker (prefill, decode with remote KV, or a
  plain local run), refusing combinations the worker's role cannot serve with a message that says
  which worker the request should have gone to;
- ``prefill_request``: the token budget of a prefill leg (one token, no minimum), enforced on the
  worker too so a prefill never streams a whole completion into a discarded stream;
- ``to_json_safe``/``from_json_safe``: engine parameters that hold ``bytes`` (TensorRT-LLM's
  ``opaque_state``) as a dict that survives JSON (discovery, logs, the HTTP API) as well as msgpack.
"""

from __future__ import annotations

import argparse
import base64
import logging
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.protocol.llm import PreprocessedRequest

logger = logging.getLogger(__name__)

ROLE_AGG = "agg"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_AGG, ROLE_PREFILL, ROLE_DECODE)

Stage = Literal["prefill", "decode", "local"]
STAGE_PREFILL: Stage = "prefill"  # compute the prompt's KV, hold it, answer with transfer parameters
STAGE_DECODE: Stage = "decode"  # pull the prompt's KV from a prefill worker, then generate
STAGE_LOCAL: Stage = "local"  # prefill and decode here (agg, or a decode worker's local fallback)

BYTES_TAG = "__bytes_b64__"


def worker_role(args: argparse.Namespace) -> str:
    """The worker's ``--role`` (``agg`` when the namespace has none, as in tests and tools that
    build an engine directly)."""
    role = getattr(args, "role", None) or ROLE_AGG
    if role not in ROLES:
        raise ConfigError(f"an engine worker's role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def request_stage(role: str, request: PreprocessedRequest, *, engine: str) -> Stage:
    """What ``request`` asks of a worker with ``role``.

    A prefill leg belongs on a prefill worker only: an agg or decode engine has no transfer
    connector set up to hold its KV for another worker. A prefill worker serves nothing but
    prefill legs. A decode worker without parameters prefills locally (the frontend's
    ``--decode-fallback``); an agg worker given parameters ignores them and prefills locally,
    which costs time but never correctness.
    """
    if request.prefill_only:
        if role != ROLE_PREFILL:
            raise InvalidRequestError(
                f"prefill-only request {request.request_id!r} reached a {engine} worker with role {role}; "
                f"prefill legs go to workers started with --role prefill"
            )
        return STAGE_PREFILL
    if role == ROLE_PREFILL:
        raise InvalidRequestError(
            f"request {request.request_id!r} reached a {engine} prefill worker without prefill_only; a prefill "
            f"worker computes prompt KV for decode workers and serves no completions"
        )
    if request.disaggregated_params:
        if role == ROLE_DECODE:
            return STAGE_DECODE
        logger.warning(
            "disaggregated params ignored on an agg worker engine=%s request_id=%s effect=local_prefill",
            engine, request.request_id,
        )
    return STAGE_LOCAL


def prefill_request(request: PreprocessedRequest) -> PreprocessedRequest:
    """The prefill leg with its budget pinned: one token, no minimum, EOS allowed to end it."""
    stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=None, ignore_eos=False)
    return msgspec.structs.replace(request, stop=stop)


def to_json_safe(value: Any) -> Any:
    """``value`` with every ``bytes`` as ``{BYTES_TAG: base64}`` and tuples as lists.

    Raises ``TypeError`` for anything JSON cannot hold (objects, non-string keys), naming it, so a
    caller decides to drop that field rather than send something the other side cannot rebuild.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v) for v in value]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"a key of type {type(key).__name__} cannot be carried as JSON: {key!r:.40}")
            out[key] = to_json_safe(item)
        return out
    raise TypeError(f"a value of type {type(value).__name__} cannot be carried as JSON")


def from_json_safe(value: Any) -> Any:
    """The inverse of ``to_json_safe``: tagged base64 back to ``bytes``."""
    if isinstance(value, list):
        return [from_json_safe(v) for v in value]
    if isinstance(value, Mapping):
        if set(value) == {BYTES_TAG}:
            try:
                return base64.b64decode(value[BYTES_TAG], validate=True)
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(f"disaggregated_params holds bad base64 bytes: {exc}") from None
        return {k: from_json_safe(v) for k, v in value.items()}
    return value
