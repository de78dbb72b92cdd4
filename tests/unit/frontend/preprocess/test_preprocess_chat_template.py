"""Chat template rendering: the tiny model's template, HF helpers, sandboxing and bad messages."""

from __future__ import annotations

import re

import pytest

from dynamod.daemon.frontend.preprocess import ChatTemplate, Tokenizer
from dynamod.daemon.models import resolve_model
from dynamod.shared.errors import ConfigError, InvalidRequestError

TINY = resolve_model("tiny")
TEMPLATE = ChatTemplate.from_model(TINY)
assert TEMPLATE is not None


def header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def test_system_user_assistant_with_generation_prompt() -> None:
    prompt = TEMPLATE.render(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Weather?"},
        ],
        add_generation_prompt=True,
    )
    assert prompt == (
        "<|begin_of_text|>"
        + header("system") + "You are terse.<|eot_id|>"
        + header("user") + "Hi<|eot_id|>"
        + header("assistant") + "Hello.<|eot_id|>"
        + header("user") + "Weather?<|eot_id|>"
        + header("assistant")
    )  # fmt: skip


def test_without_generation_prompt_ends_after_last_message() -> None:
    prompt = TEMPLATE.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == "<|begin_of_text|>" + header("user") + "Hi<|eot_id|>"


def test_rendered_prompt_tokenizes_to_single_special_ids() -> None:
    tokenizer = Tokenizer.from_dir(TINY.path)
    ids = tokenizer.encode(TEMPLATE.render([{"role": "user", "content": "Hi"}]))
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.token_to_id("<|start_header_id|>")) == 2
    assert ids[-1] == tokenizer.token_to_id("\u010a\u010a")  # the "\n\n" after the assistant header


def test_text_parts_name_and_developer_role() -> None:
    prompt = TEMPLATE.render(
        [
            {"role": "developer", "content": [{"type": "text", "text": "Rules"}]},
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert header("system") + "Rules<|eot_id|>" in prompt
    assert header("user") + "a\nb<|eot_id|>" in prompt


def test_tool_calls_and_tool_results() -> None:
    prompt = TEMPLATE.render(
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    )
    assert '{"name": "get_weather", "parameters": {"type": "object"}}' in prompt
    assert (
        header("assistant") + '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>' in prompt
    )
    assert header("ipython") + "21C<|eot_id|>" in prompt
    assert prompt.endswith(header("assistant"))


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "at least one message"),
        ("hello", "must be a list"),
        ([{"content": "no role"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "expected one of"),
        ([{"role": "user"}], "messages[0].content is missing"),
        ([{"role": "user", "content": 5}], "must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "images are not supported: this model takes text parts only",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "content[0].text must be a string"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages"),
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            "not valid JSON",
        ),
        ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}], "tool_calls[0]"),
    ],
)
def test_bad_messages_are_invalid_requests(messages: object, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        TEMPLATE.render(messages)
    assert fragment in str(info.value)
    assert info.value.http_status == 400


def test_raise_exception_in_template_becomes_invalid_request() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    )
    with pytest.raises(InvalidRequestError, match="Conversation must start with user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_helpers_match_hf() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{{ strftime_now('%Y') }}|{{ messages[0] | tojson }}|"
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}",
        special_tokens={"bos_token": "<s>"},
    )
    prompt = template.render([{"role": "user", "content": "ü<b>"}, {"role": "user", "content": "second"}])
    assert re.fullmatch(r'<s>\d{4}\|\{"role": "user", "content": "ü<b>"\}\|ü<b>', prompt)


def test_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError):
        template.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{% set d = {} %}{{ d.update({'a': 1}) }}")
    with pytest.raises(InvalidRequestError):
        mutating.render([{"role": "user", "content": "x"}])


def test_template_that_does_not_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
