"""vLLM's own engine flags, passed through from the daemon's command line.

``dynamod --role agg --engine vllm --model DIR --vllm-args "--block-size 32 --enforce-eager"``:
everything in ``--vllm-args`` is vLLM's ``AsyncEngineArgs`` command line, parsed by vLLM's own
parser when the engine starts (so every flag of the installed vLLM works, with its own
validation). Flags the worker daemon passes through unparsed (``args.engine_args``) are appended.

This module only reads and rewrites the token list, without importing vLLM (importing it takes
seconds, and ``--help`` must stay fast). Rewrites:

- ``--model`` is the daemon's ``--model`` directory (vLLM must not be pointed elsewhere);
- ``--block-size`` defaults to 64 when absent: the model card needs the block size before the
  engine runs, vLLM's own default differs by platform (16 on GPU, 128 on CPU), and 64 is valid on
  both (CPU attention needs a multiple of 32);
- prefix caching is on unless explicitly turned off, since KV events exist only with it;
- ``--kv-events-config`` becomes the one the worker planned (kv_endpoints.py), built on the
  operator's if they gave one;
- ``--disable-log-stats`` is added unless the operator chose: the adapter reads the engine's
  scheduler stats through its own stat logger and vLLM's periodic log lines are noise here;
- ``--kv-transfer-config`` is added for prefill and decode workers unless the operator gave one
  (disagg.py says which connector and why).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from dynamod.daemon.engines.common.flags import KV_EVENTS_FLAG, has_flag, int_flag, without_flag
from dynamod.shared.errors import ConfigError

DEFAULT_BLOCK_SIZE = 64
KV_TRANSFER_FLAG = "--kv-transfer-config"


@dataclass(frozen=True, slots=True)
class FlagEstimates:
    """What the model card needs before the engine runs, as far as the flags say."""

    block_size: int
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    num_gpu_blocks: int | None
    data_parallel_size: int


def estimates(tokens: Sequence[str]) -> FlagEstimates:
    return FlagEstimates(
        block_size=int_flag(tokens, "--block-size") or DEFAULT_BLOCK_SIZE,
        max_model_len=int_flag(tokens, "--max-model-len"),
        max_num_seqs=int_flag(tokens, "--max-num-seqs"),
        max_num_batched_tokens=int_flag(tokens, "--max-num-batched-tokens"),
        num_gpu_blocks=int_flag(tokens, "--num-gpu-blocks-override"),
        data_parallel_size=int_flag(tokens, "--data-parallel-size", "-dp") or 1,
    )


def prefix_caching_disabled(tokens: Sequence[str]) -> bool:
    """True when the operator turned prefix caching off (the last of the two flags wins)."""
    state = None
    for token in tokens:
        if token == "--enable-prefix-caching":
            state = True
        elif token == "--no-enable-prefix-caching":
            state = False
    return state is False


def engine_argv(
    tokens: Sequence[str],
    *,
    model_path: str,
    kv_events_config: dict[str, object],
    max_model_len: int | None = None,
    kv_transfer_config: dict[str, object] | None = None,
) -> list[str]:
    """The full vLLM command line to parse, after the rewrites in the module docstring."""
    if has_flag(tokens, "--model"):
        raise ConfigError("do not pass --model inside the vLLM arguments; the daemon's --model names the model")
    argv = ["--model", model_path, *without_flag(tokens, KV_EVENTS_FLAG)]
    if not has_flag(tokens, "--block-size"):
        argv += ["--block-size", str(DEFAULT_BLOCK_SIZE)]
    if max_model_len and not has_flag(tokens, "--max-model-len"):
        argv += ["--max-model-len", str(max_model_len)]
    if not has_flag(tokens, "--enable-prefix-caching", "--no-enable-prefix-caching"):
        argv.append("--enable-prefix-caching")
    if not has_flag(tokens, "--disable-log-stats", "--no-disable-log-stats"):
        argv.append("--disable-log-stats")
    argv += [KV_EVENTS_FLAG, json.dumps(kv_events_config, separators=(",", ":"))]
    if kv_transfer_config is not None and not has_flag(tokens, KV_TRANSFER_FLAG):
        argv += [KV_TRANSFER_FLAG, json.dumps(kv_transfer_config, separators=(",", ":"))]
    return argv
