"""Replies as each model family writes them (formats from the families' chat templates and model
cards: Qwen 2.5/3 and Hermes, Llama 3.1-3.3, Mistral v0.3 and Small 3.2, Llama 3.2/4 pythonic,
DeepSeek-R1, gpt-oss), with what the parsers must make of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOOLS = ["get_weather", "get_time", "search_web", "get_current_temperature", "get_temperature_date"]


@dataclass(frozen=True)
class Recorded:
    name: str
    tool_parser: str | None
    reasoning_parser: str | None
    text: str
    content: str
    reasoning: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


RECORDED = [
    Recorded(
        "hermes_qwen25_parallel", "hermes", None,
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA",'
        ' "date": "2024-10-01"}}\n</tool_call>',
        "",
        calls=[
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    Recorded(
        "hermes_preamble_unicode_escapes", "hermes", None,
        "I'll look that up for you.\n\n<tool_call>\n"
        '{"name": "search_web", "arguments": {"query": "Zürich \\"weather\\" {today} </tool>", "n": 3, '
        '"filters": {"lang": ["de", "en"], "safe": true}}}\n</tool_call>',
        "I'll look that up for you.\n\n",
        calls=[("search_web", {"query": 'Zürich "weather" {today} </tool>', "n": 3, "filters": {"lang": ["de", "en"], "safe": True}})],
    ),
    Recorded(
        "hermes_arguments_before_name", "hermes", None,
        '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>',
        "",
        calls=[("get_time", {"tz": "UTC"})],
    ),
    Recorded(
        "hermes_arguments_as_string", "hermes", None,
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
        "",
        calls=[("get_weather", {"city": "Oslo"})],
    ),
    Recorded(
        "hermes_unknown_function_is_content", "hermes", None,
        'Sure.\n<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        'Sure.\n<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
    ),
    Recorded(
        "hermes_not_json_is_content", "hermes", None,
        "<tool_call>\nget_weather(city='Paris')\n</tool_call> done",
        "<tool_call>\nget_weather(city='Paris')\n</tool_call> done",
    ),
    Recorded(
        "hermes_plain_answer_with_angle_brackets", "hermes", None,
        "Use <tool> tags or a <tool_cal> typo; 3 < 4.",
        "Use <tool> tags or a <tool_cal> typo; 3 < 4.",
    ),
    Recorded(
        "qwen3_think_then_call", "hermes", "qwen3",
        "<think>\nThe user asks for the weather in Paris; get_weather does that.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        reasoning="\nThe user asks for the weather in Paris; get_weather does that.\n",
        calls=[("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    Recorded(
        "qwen3_think_then_answer", None, "qwen3",
        "<think>\nSimple greeting.\n</think>\n\nHello! How can I help?",
        "Hello! How can I help?",
        reasoning="\nSimple greeting.\n",
    ),
    Recorded(
        "qwen3_no_thinking", "hermes", "qwen3",
        "Paris is the capital of France.",
        "Paris is the capital of France.",
    ),
    Recorded(
        "deepseek_r1_no_opening_tag", None, "deepseek_r1",
        "Okay, 9.11 vs 9.9: compare tenths, 1 < 9.\n</think>\n\n9.9 is larger.",
        "9.9 is larger.",
        reasoning="Okay, 9.11 vs 9.9: compare tenths, 1 < 9.\n",
    ),
    Recorded(
        "deepseek_r1_with_opening_tag", None, "deepseek_r1",
        "<think>\nhmm, <thinking> is not a tag here</think>The answer is 4.",
        "The answer is 4.",
        reasoning="\nhmm, <thinking> is not a tag here",
    ),
    Recorded(
        "deepseek_r1_cut_in_reasoning", None, "deepseek_r1",
        "<think>Let me think about this carefully and",
        "",
        reasoning="Let me think about this carefully and",
    ),
    Recorded(
        "gpt_oss_analysis_then_final", None, "gpt_oss",
        "<|channel|>analysis<|message|>User says hi. Reply briefly.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hi there! <|tags|> stay.<|return|>",
        "Hi there! <|tags|> stay.",
        reasoning="User says hi. Reply briefly.",
    ),
    Recorded(
        "gpt_oss_plain", None, "gpt_oss",
        "No harmony headers at all.",
        "No harmony headers at all.",
    ),
    Recorded(
        "llama3_python_tag_two_calls", "llama3_json", None,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
        '{"name": "get_time", "parameters": {"tz": "America/Lima"}}',
        "",
        calls=[("get_weather", {"city": "Lima"}), ("get_time", {"tz": "America/Lima"})],
    ),
    Recorded(
        "llama3_bare_json_call", "llama3_json", None,
        '{"name": "search_web", "parameters": {"query": "llama {3} \\"json\\"", "k": [1, 2, {"x": null}]}}',
        "",
        calls=[("search_web", {"query": 'llama {3} "json"', "k": [1, 2, {"x": None}]})],
    ),
    Recorded(
        "llama3_plain_answer", "llama3_json", None,
        "The weather in Lima is mild {usually}.",
        "The weather in Lima is mild {usually}.",
    ),
    Recorded(
        "llama3_json_answer_not_a_call", "llama3_json", None,
        '{"result": 42, "name_hint": "x"}',
        '{"result": 42, "name_hint": "x"}',
    ),
    Recorded(
        "mistral_v3_array", "mistral", None,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}]',
        "",
        calls=[("get_weather", {"city": "Rome"}), ("get_time", {"tz": "Europe/Rome"})],
    ),
    Recorded(
        "mistral_v11_name_args", "mistral", None,
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome [ARGS]"}[TOOL_CALLS]get_time[ARGS]{}',
        "Let me check.",
        calls=[("get_weather", {"city": "Rome [ARGS]"}), ("get_time", {})],
    ),
    Recorded(
        "mistral_marker_without_call", "mistral", None,
        "[TOOL_CALLS] sorry, no tool fits",
        "[TOOL_CALLS] sorry, no tool fits",
    ),
    Recorded(
        "pythonic_llama32_two_calls", "pythonic", None,
        '[get_weather(city="San Francisco", unit=\'celsius\', days=3), '
        'search_web(query="a, b (c) [d]", filters={"lang": ["en"], "safe": True}, limit=None)]',
        "",
        calls=[
            ("get_weather", {"city": "San Francisco", "unit": "celsius", "days": 3}),
            ("search_web", {"query": "a, b (c) [d]", "filters": {"lang": ["en"], "safe": True}, "limit": None}),
        ],
    ),
    Recorded(
        "pythonic_llama4_tags", "pythonic", None,
        "<|python_start|>[get_time(tz=\"UTC\")]<|python_end|>",
        "",
        calls=[("get_time", {"tz": "UTC"})],
    ),
    Recorded(
        "pythonic_list_of_numbers_is_content", "pythonic", None,
        "[1, 2, 3]",
        "[1, 2, 3]",
    ),
    Recorded(
        "pythonic_plain_answer", "pythonic", None,
        "It is sunny [source: met office].",
        "It is sunny [source: met office].",
    ),
]

# Malformed calls: a unary response (parsed in one pass) gives their text back as content.
MALFORMED = [
    Recorded(
        "hermes_unclosed_arguments", "hermes", None,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
    ),
    Recorded(
        "hermes_cut_by_max_tokens", "hermes", None,
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"ci',
    ),
    Recorded(
        "llama3_invalid_arguments", "llama3_json", None,
        '{"name": "get_weather", "parameters": {"city": }}',
        '{"name": "get_weather", "parameters": {"city": }}',
    ),
    Recorded(
        "mistral_cut_array", "mistral", None,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Ro',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Ro',
    ),
]
