"""``n > 1`` and batched completion prompts through real processes (a frontend and a mocker
worker) with the official ``openai`` client, unary and streaming: every choice present once with
its index, prompts mapped to ``prompt_index * n + i``, usage counting each prompt once and every
choice's tokens, and the refusals that remain (400s naming the parameter)."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from tests.integration.frontend.test_frontend_support import cluster_fixture, openai_fixture

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Say something."}]
FIXED = {"ignore_eos": True}  # every choice runs to max_tokens: token counts are exact


cluster = cluster_fixture("fanout-cluster", workers=1, speedup=100.0)
api = openai_fixture(60)


def test_chat_n_unary_gives_n_distinct_choices_and_summed_usage(api: openai.OpenAI) -> None:
    one = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=FIXED)
    resp = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3, extra_body=FIXED)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1, "siblings must be sampled independently"
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert resp.usage.completion_tokens == 3 * 8
    assert resp.usage.total_tokens == one.usage.prompt_tokens + 24


def test_chat_n_with_seed_is_reproducible_and_siblings_differ(api: openai.OpenAI) -> None:
    def texts() -> list[str]:
        resp = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3, seed=11, extra_body=FIXED)
        return [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]

    first = texts()
    assert texts() == first
    assert len(set(first)) == 3
    single = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, seed=11, extra_body=FIXED)
    assert single.choices[0].message.content == first[0]  # choice 0 uses the request's own seed


def test_chat_n_streaming_interleaves_choices_by_index(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, n=3, stream=True, stream_options={"include_usage": True},
        extra_body=FIXED,
    )
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    roles: dict[int, int] = defaultdict(int)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason is not None:
                assert choice.index not in finish, "one finish per choice"
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert dict(roles) == {0: 1, 1: 1, 2: 1}  # each choice's first chunk names the role, once
    assert all(text[i] for i in range(3))
    assert usage is not None and usage.completion_tokens == 30


def test_completions_batched_prompts_and_n_unary(api: openai.OpenAI) -> None:
    prompts = ["Alpha says", "Bravo says", "Charlie says"]
    singles = [api.completions.create(model="tiny", prompt=p, max_tokens=4, extra_body=FIXED) for p in prompts]
    resp = api.completions.create(model="tiny", prompt=prompts, max_tokens=4, n=2, echo=True, extra_body=FIXED)
    assert sorted(c.index for c in resp.choices) == list(range(6))
    for c in resp.choices:
        assert c.text.startswith(prompts[c.index // 2]), (c.index, c.text)  # index = prompt_index * n + i
        assert c.finish_reason == "length"
    assert resp.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # each prompt once
    assert resp.usage.completion_tokens == 6 * 4


def test_completions_token_id_batch_streaming(api: openai.OpenAI) -> None:
    prompts = [[100, 101, 102], [200, 201], [300]]
    stream = api.completions.create(
        model="tiny", prompt=prompts, max_tokens=5, stream=True, stream_options={"include_usage": True},
        extra_body={**FIXED, "return_token_ids": True},
    )
    tokens: dict[int, list[int]] = defaultdict(list)
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            tokens[choice.index] += choice.model_extra.get("token_ids") or []
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert all(len(tokens[i]) == 5 for i in range(3))
    assert usage is not None and usage.prompt_tokens == 6 and usage.completion_tokens == 15


def test_best_of_and_bad_batches_are_400s(api: openai.OpenAI) -> None:
    cases = [
        (dict(prompt="Hi", n=1, best_of=3), "best_of"),
        (dict(prompt=["Hi", 5]), "prompt"),
        (dict(prompt=[[1, 2], []]), "prompt"),
        (dict(prompt="Hi", n=0), "n"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model="tiny", max_tokens=3, **kwargs)
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, (kwargs, body)
    # best_of equal to n is just n.
    resp = api.completions.create(model="tiny", prompt="Hi", max_tokens=3, n=2, best_of=2, extra_body=FIXED)
    assert len(resp.choices) == 2
