"""Prefill/decode disaggregation on vLLM: its KV connector does the transfer, dynamod carries the
parameters.

A worker started with ``--role prefill`` or ``--role decode`` gets vLLM's ``--kv-transfer-config``
set to the NIXL connector (``kv_role`` ``kv_both``, so either end works with one config) unless the
operator passes a connector of their own; vLLM's default buffer device is the platform's own
(host memory on the CPU build, device memory on CUDA), which is what NIXL reads on each.

Per request (the frontend's contract, daemon/engines/common/disagg.py):

- prefill leg: ``SamplingParams.extra_args["kv_transfer_params"] = {"do_remote_decode": True}``
  (how vLLM's own OpenAI server passes a request's ``kv_transfer_params`` to the engine); the
  connector holds the prompt's blocks after the one-token run and the final ``RequestOutput``
  carries ``kv_transfer_params`` (``do_remote_prefill``, ``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port`` of the NIXL side
  channel, ``tp_size``...), which become the frame's ``disaggregated_params``;
- decode leg: those parameters, unchanged, as the decode request's ``kv_transfer_params``; the
  decode engine reads the blocks from the prefill engine and samples from there.

The prefill engine frees the blocks once the decode engine has read them, or when its lease runs out
(``kv_lease_duration``, 30 s by default, in ``kv_connector_extra_config``).

The NIXL side channel (a ZMQ socket the prefill engine listens on for handshakes) is configured
by vLLM only through ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, read in the engine's own
processes; ``side_channel_env`` chooses them (a free port, so several engines share a host) unless
the operator set them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from dynamod.daemon.engines.common.disagg import ROLE_AGG
from dynamod.daemon.engines.common.flags import json_object_flag
from dynamod.daemon.engines.vllm.flags import KV_TRANSFER_FLAG
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.transport.ports import free_port_run

DEFAULT_CONNECTOR = "NixlConnector"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"

# The operator's own side-channel settings, read once before any engine of this process sets them:
# with --num-workers N each engine needs its own port, and the first engine's must not be taken
# for an operator's choice.
_OPERATOR_SIDE_CHANNEL = {k: os.environ.get(k) for k in (SIDE_CHANNEL_HOST_ENV, SIDE_CHANNEL_PORT_ENV)}


def user_kv_transfer_config(tokens: Sequence[str]) -> dict[str, Any] | None:
    """The operator's ``--kv-transfer-config`` JSON, if any."""
    return json_object_flag(tokens, KV_TRANSFER_FLAG)


def kv_transfer_config(role: str, tokens: Sequence[str]) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` to add for ``role``: None when there is nothing to add (agg, or
    the operator configured a connector themselves, which is then used as given)."""
    if role == ROLE_AGG:
        return None
    user = user_kv_transfer_config(tokens)
    if user is not None:
        if not user.get("kv_connector"):
            raise ConfigError(f"{KV_TRANSFER_FLAG} names no kv_connector; a {role} worker needs one to move KV")
        return None
    return {"kv_connector": DEFAULT_CONNECTOR, "kv_role": "kv_both"}


def side_channel_env(host: str, data_parallel_size: int) -> dict[str, str]:
    """The NIXL side-channel variables for the next engine: the operator's where they set them,
    else the daemon's advertised host and a run of free ports (vLLM adds the DP rank to the port).
    """
    env = {}
    operator_host = _OPERATOR_SIDE_CHANNEL[SIDE_CHANNEL_HOST_ENV]
    operator_port = _OPERATOR_SIDE_CHANNEL[SIDE_CHANNEL_PORT_ENV]
    env[SIDE_CHANNEL_HOST_ENV] = operator_host or (host if host not in ("", "0.0.0.0", "::") else "127.0.0.1")
    env[SIDE_CHANNEL_PORT_ENV] = operator_port or str(free_port_run(max(1, data_parallel_size), "127.0.0.1"))
    return env


def prefill_transfer_params() -> dict[str, Any]:
    """``kv_transfer_params`` of a prefill leg: hold the blocks for a remote decode."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def decode_transfer_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A decode leg's ``kv_transfer_params``: the prefill's, checked to be vLLM's.

    Parameters from another engine's prefill (the mocker's block lists, SGLang's bootstrap room)
    would make vLLM's connector skip the transfer and prefill silently; refuse them instead.
    """
    if not params.get("do_remote_prefill"):
        keys = ", ".join(sorted(params)) or "none"
        raise InvalidRequestError(
            f"disaggregated_params are not vLLM kv_transfer_params from a vLLM prefill worker "
            f"(no do_remote_prefill; keys: {keys}); prefill and decode pools must run the same engine"
        )
    return dict(params)
