"""The stop settings of a request as engine sampling arguments (the same for every engine)."""

from __future__ import annotations

from typing import Any

from dynamod.shared.protocol.llm import PreprocessedRequest


def stop_kwargs(request: PreprocessedRequest, *, context_length: int, max_key: str = "max_tokens",
                min_key: str = "min_tokens") -> dict[str, Any]:
    """Token budget, stop token ids and ``ignore_eos`` under the engine's names for the two budget keys.

    An unset ``max_tokens`` fills the rest of the context (16 when the context length is unknown),
    since the frontend has already checked that the prompt fits.
    """
    stop = request.stop
    max_tokens = stop.max_tokens
    if max_tokens is None:
        max_tokens = max(1, context_length - len(request.token_ids)) if context_length else 16
    out: dict[str, Any] = {max_key: max_tokens}
    if stop.min_tokens:
        out[min_key] = stop.min_tokens
    if stop.stop_token_ids:
        out["stop_token_ids"] = list(stop.stop_token_ids)
    if stop.ignore_eos:
        out["ignore_eos"] = True
    return out
