"""Tool-call and reasoning parsers for model output, one module per model family.

The API every endpoint uses (chat completions here, the Responses API beside it)::

    settings = ToolSettings.from_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    parser = build_output_parser(tool_call_parser_name=..., reasoning_parser_name=..., tools=settings)
    for text in deltas:               # any split: the result does not depend on it
        out = parser.feed(text)       # ParsedDelta: content, reasoning, tool_calls (ToolCallDelta)
    out = parser.finish()             # what was held back at the end (or finish(last_text))
    parser.tool_calls                 # the whole calls (ToolCall: id, name, JSON arguments)
    parser.finish_reason("stop")      # "tool_calls" when the model called a tool

``TOOL_CALL_PARSERS`` and ``REASONING_PARSERS`` list the names a worker may publish in its model
card. Parsers hold back only text that may still turn out to be markup, never more.
"""

from dynamod.daemon.frontend.parsers.base import (
    ParsedDelta,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallTracker,
)
from dynamod.daemon.frontend.parsers.output import OutputParser, ToolSettings, build_output_parser, tool_names
from dynamod.daemon.frontend.parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "OutputParser",
    "ParsedDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallTracker",
    "ToolSettings",
    "build_output_parser",
    "tool_names",
]
