"""``ChatTemplate`` renders with its globals flattened once: the same text and errors as jinja's own
``Template.render``, and nothing leaks from one render into the next."""

from __future__ import annotations

import pytest

from dynamod.daemon.frontend.preprocess import ChatTemplate
from dynamod.daemon.frontend.preprocess.chat_template import normalize_messages
from dynamod.shared.errors import InvalidRequestError

SOURCE = """{{- bos_token -}}
{%- set ns = namespace(count=0) -%}
{%- for message in messages -%}
{%- set ns.count = ns.count + 1 -%}
{%- if message['role'] == 'tool' -%}{{ raise_exception('no tools here') }}{%- endif -%}
[{{ loop.index }}/{{ range(messages | length) | list | length }} {{ message['role'] }}]
{{- message['content'] }}
{%- if message['role'] == 'user' and loop.last %}{% break %}{% endif -%}
{%- endfor -%}
{%- if tools %} tools={{ tools | tojson }}{% endif -%}
{{- ' n=' ~ ns.count -}}
{%- if add_generation_prompt %} <assistant>{% endif -%}
{%- if shadow is defined %} shadow={{ shadow }}{% endif -%}
{%- if lipsum is defined and lipsum is not string %} has-lipsum{% endif -%}
{%- set leaked = 'x' -%}
{%- if leaked_before is defined %} LEAK{% endif -%}
"""

MESSAGES = [{"role": "system", "content": "Be brief. é 中"}, {"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def jinja_render(template: ChatTemplate, **variables: object) -> str:
    """The reference: jinja's own ``Template.render`` with the same variables."""
    return template._template.render(**variables)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"add_generation_prompt": False},
        {"tools": TOOLS},
        {"template_kwargs": {"shadow": "mine", "lipsum": "a string now"}},
    ],
)
def test_render_equals_jinjas_render(kwargs: dict) -> None:
    template = ChatTemplate(SOURCE, special_tokens={"bos_token": "<s>", "eos_token": None})
    got = template.render(MESSAGES, **kwargs)
    variables = dict(kwargs.get("template_kwargs") or {})
    variables.update(
        bos_token="<s>", messages=normalize_messages(MESSAGES),
        add_generation_prompt=kwargs.get("add_generation_prompt", True),
    )
    if "tools" in kwargs:
        variables["tools"] = kwargs["tools"]
    assert got == jinja_render(template, **variables)
    assert got.startswith("<s>[1/2 system]Be brief. é 中[2/2 user]Hi")
    assert " n=2" in got
    # A request's variables win over the template's globals, as in jinja.
    assert ("has-lipsum" in got) == ("template_kwargs" not in kwargs)


def test_renders_are_independent() -> None:
    template = ChatTemplate(SOURCE, special_tokens={"bos_token": "<s>"})
    first = template.render(MESSAGES, template_kwargs={"shadow": "one"})
    second = template.render(MESSAGES)
    assert "shadow=one" in first and "shadow" not in second
    assert "LEAK" not in first + second
    assert template.render(MESSAGES) == second


def test_template_errors_are_still_invalid_requests() -> None:
    template = ChatTemplate(SOURCE, special_tokens={"bos_token": "<s>"})
    with pytest.raises(InvalidRequestError, match="no tools here"):
        template.render([{"role": "tool", "content": "x", "tool_call_id": "1"}])
    broken = ChatTemplate("{{ messages[0]['content'] / 2 }}")
    with pytest.raises(InvalidRequestError, match="TypeError"):
        broken.render([{"role": "user", "content": "x"}])
