"""Structured-output constraints (``GuidedDecoding``) as grammars for the llguidance engine.

One grammar engine decides what a valid constraint is, for the whole system: the frontend compiles
every constraint here before routing, so a schema that cannot be enforced is a 400 naming the
parameter instead of an engine error mid-stream (or worse, unconstrained text under a 200); the
mocker compiles the same grammar against its tokenizer and samples under its token masks.

llguidance (Rust, no torch) is imported on first use only: requests without a constraint never
load it. Compiling is cached by the constraint's canonical bytes, since clients send the same
schema over and over.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import GuidedDecoding

if TYPE_CHECKING:
    import llguidance

_CACHE_SIZE = 256
MAX_CHOICES = 1024

# JSON without optional whitespace ({"a":1}) unless the client gives a pattern for it: what vLLM's
# guidance backend does too, and a sampler that may insert whitespace anywhere wanders.
_COMPACT_JSON = {"whitespace_flexible": False}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a broken install; llguidance is a core dependency
        raise InvalidRequestError(
            "structured outputs need the llguidance package, which is not installed on this host"
        ) from exc
    return llguidance


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar (its JSON form) for one constraint. Raises ``ValueError`` for text
    that cannot even be converted (a GBNF grammar that does not parse)."""
    llg = _llg()
    matcher = llg.LLMatcher
    kind = guided.kind
    if kind == "json":
        schema = guided.json
        if schema is False:
            raise ValueError("the schema false admits no value")
        options = dict(_COMPACT_JSON)
        if guided.whitespace_pattern is not None:
            options = {"whitespace_pattern": guided.whitespace_pattern}
        # The schema true admits any value: llguidance takes options only on an object schema.
        return str(matcher.grammar_from_json_schema({} if schema is True else schema, overrides=options))
    if kind == "regex":
        return str(matcher.grammar_from_regex(guided.regex))
    if kind == "choice":
        return str(llg.grammar_from("choice", msgspec.json.encode(guided.choice).decode()))
    return str(llg.grammar_from("grammar", guided.grammar or ""))


def constraint_key(guided: GuidedDecoding) -> bytes:
    """Canonical bytes of a constraint (the cache key): equal constraints, equal keys."""
    return msgspec.msgpack.encode(guided)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile(key: bytes) -> str:
    guided = msgspec.msgpack.decode(key, type=GuidedDecoding)
    try:
        grammar = grammar_text(guided)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {_describe(guided)}: {exc}") from None
    error = _llg().LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"invalid {_describe(guided)}: {_first_lines(error)}")
    return grammar


def compile_guided(guided: GuidedDecoding, *, param: str | None = None) -> str:
    """The checked grammar of a constraint, or ``InvalidRequestError`` (400) naming ``param``, the
    request field the constraint came from. Cached: a repeated constraint costs one lookup."""
    if guided.kind == "choice":
        choices = guided.choice or []
        if not choices:
            raise InvalidRequestError("the choice list is empty; give at least one choice", param=param)
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(f"the choice list takes at most {MAX_CHOICES} choices", param=param)
    try:
        key = constraint_key(guided)
    except (OverflowError, TypeError) as exc:  # e.g. an integer beyond 64 bits inside a schema
        raise InvalidRequestError(f"invalid {_describe(guided)}: {exc}", param=param) from None
    try:
        return _compile(key)
    except InvalidRequestError as exc:
        exc.param = param
        raise


def _describe(guided: GuidedDecoding) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[guided.kind]


def _first_lines(message: str, limit: int = 4) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(line.strip() for line in lines[:limit])


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher over ``tokenizer`` for a grammar from ``compile_guided`` (engine side)."""
    matcher = _llg().LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"the output constraint does not compile for this model: {matcher.get_error()}")
    return matcher
