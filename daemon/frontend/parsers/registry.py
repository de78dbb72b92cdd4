"""The parsers by name: the names workers publish in their model card (``--tool-call-parser``,
``--reasoning-parser``) and the frontend looks up. The names themselves are wire vocabulary and
live in ``shared/protocol/model_card.py`` (the worker checks its flags against them without
importing the frontend); this maps each to its parser, and a test holds the two to the same set."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

from dynamod.daemon.frontend.parsers.base import ReasoningParser, ToolCallParser
from dynamod.daemon.frontend.parsers.gpt_oss import GptOssReasoningParser
from dynamod.daemon.frontend.parsers.hermes import HermesToolParser
from dynamod.daemon.frontend.parsers.llama3_json import Llama3JsonToolParser
from dynamod.daemon.frontend.parsers.mistral import MistralToolParser
from dynamod.daemon.frontend.parsers.pythonic import PythonicToolParser
from dynamod.daemon.frontend.parsers.think_tags import ThinkTagReasoningParser

logger = logging.getLogger(__name__)

ReasoningParserFactory = Callable[[], ReasoningParser]
T = TypeVar("T")

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}

REASONING_PARSERS: dict[str, ReasoningParserFactory] = {
    "basic": lambda: ThinkTagReasoningParser(starts_in_reasoning=False),
    "qwen3": lambda: ThinkTagReasoningParser(starts_in_reasoning=False),
    "deepseek_r1": lambda: ThinkTagReasoningParser(starts_in_reasoning=True),
    "gpt_oss": GptOssReasoningParser,
}

_warned: set[str] = set()


def tool_call_parser(name: str | None) -> type[ToolCallParser] | None:
    """The tool-call parser class called ``name``; None for no name or an unknown one (logged
    once: a card from a newer worker must not fail requests, its text just stays content)."""
    return _named("tool_call_parser", name, TOOL_CALL_PARSERS)


def reasoning_parser(name: str | None) -> ReasoningParserFactory | None:
    """The reasoning parser factory called ``name``; None for no name or an unknown one."""
    return _named("reasoning_parser", name, REASONING_PARSERS)


def _named(kind: str, name: str | None, known: Mapping[str, T]) -> T | None:
    if not name:
        return None
    found = known.get(name)
    if found is None:
        _warn_unknown(kind, name, known)
    return found


def _warn_unknown(kind: str, name: str, known: Mapping[str, object]) -> None:
    key = f"{kind}:{name}"
    if key in _warned:
        return
    _warned.add(key)
    logger.warning("unknown parser kind=%s name=%s known=%s action=ignored", kind, name, ",".join(sorted(known)))
