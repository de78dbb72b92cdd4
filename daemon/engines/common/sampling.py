"""Sampling settings every engine adapter maps the same way: the stop settings as engine
arguments, a choice list as a grammar, and the refusal of options an engine cannot take."""

from __future__ import annotations

import json
from typing import Any

from dynamod.shared.errors import InvalidRequestError
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


def choice_grammar(choices: list[str]) -> str:
    """A choice list as a GBNF/EBNF grammar (``root ::= "a" | "b"``) for engines whose
    structured-output API has no choice form; JSON string escapes are GBNF's literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def refuse_unsupported(request: PreprocessedRequest, names: tuple[str, ...], engine: str) -> None:
    """``InvalidRequestError`` naming the first of ``names`` the request sets: a sampling option
    this engine's API cannot take is refused, never dropped."""
    s = request.sampling
    for name in names:
        value = getattr(s, name)
        if value is not None and value != {}:
            raise InvalidRequestError(f"{name} is not supported by the {engine} engine", param=name)
