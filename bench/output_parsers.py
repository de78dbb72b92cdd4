"""CPU cost of the chat output parsers, per streamed chunk, against the formatter without one.

    python bench/output_parsers.py [--repeat 200] [--chunk-chars 4]

Each model family's reply (a few hundred characters, one tool call or a reasoning block) is fed to
a ``ChatFormatter`` in pieces of ``--chunk-chars`` characters (about one token each), as the
streaming path does, and to ``ChatFormatter.response`` whole, as the unary path does. Prints JSON:
microseconds per chunk with and without a parser, so a change that slows the hot path shows here.
"""

from __future__ import annotations

import argparse
import json
import time

from dynamod.daemon.frontend.openai.formatters import ChatFormatter, make_usage
from dynamod.daemon.frontend.parsers import ToolSettings, build_output_parser

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time", "search_web")]
ARGS = '{"city": "San Francisco, CA", "unit": "celsius", "days": 3, "notes": "' + "x" * 200 + '"}'
REPLIES = {
    "none": ("", "", "The weather in San Francisco is mild today, with fog in the morning. " * 5),
    "hermes": ("hermes", "", f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'),
    "llama3_json": ("llama3_json", "", f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}'),
    "mistral": ("mistral", "", f'[TOOL_CALLS]get_weather[ARGS]{ARGS}'),
    "pythonic": ("pythonic", "", '[get_weather(city="San Francisco, CA", unit="celsius", days=3, notes="' + "x" * 200 + '")]'),
    "deepseek_r1": ("", "deepseek_r1", "Let me think step by step about this. " * 6 + "</think>\n\nThe answer is 42. " * 3),
}


def _formatter(tool: str, reasoning: str) -> ChatFormatter:
    parser = None
    if tool or reasoning:
        settings = ToolSettings.from_request(TOOLS, None, None)
        parser = build_output_parser(tool_call_parser_name=tool or None, reasoning_parser_name=reasoning or None, tools=settings)
    return ChatFormatter("x", 0, "m", include_usage=False, continuous_usage=False, parser=parser)


def measure(tool: str, reasoning: str, text: str, chunk_chars: int, repeat: int) -> dict[str, float]:
    pieces = [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars)]
    start = time.perf_counter()
    for _ in range(repeat):
        fmt = _formatter(tool, reasoning)
        for piece in pieces[:-1]:
            fmt.chunk(piece, None, None, None)
        fmt.chunk(pieces[-1], "stop", None, None)
    stream_s = time.perf_counter() - start
    usage = make_usage(10, len(pieces), 0)
    start = time.perf_counter()
    for _ in range(repeat):
        _formatter(tool, reasoning).response(text, "stop", None, usage)
    unary_s = time.perf_counter() - start
    return {
        "chars": len(text),
        "chunks": len(pieces),
        "stream_us_per_chunk": round(stream_s / repeat / len(pieces) * 1e6, 2),
        "unary_us_per_response": round(unary_s / repeat * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200, help="replies per family [default 200]")
    ap.add_argument("--chunk-chars", type=int, default=4, help="characters per streamed chunk [default 4]")
    args = ap.parse_args()
    out = {name: measure(t, r, text, args.chunk_chars, args.repeat) for name, (t, r, text) in REPLIES.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
