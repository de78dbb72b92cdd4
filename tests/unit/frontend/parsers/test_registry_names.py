"""The parser registry and the names workers may publish (shared/protocol/model_card.py) agree:
a name a worker accepts always finds a parser in the frontend, and every parser is reachable."""

from dynamod.daemon.frontend.parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS
from dynamod.shared.protocol.model_card import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES


def test_tool_call_parser_names_match_the_registry() -> None:
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_CALL_PARSER_NAMES)


def test_reasoning_parser_names_match_the_registry() -> None:
    assert sorted(REASONING_PARSERS) == sorted(REASONING_PARSER_NAMES)
