"""``/v1/responses`` end to end: a real frontend process and a mocker worker, driven by the
official client, unary and streaming, with a conversation chained by ``previous_response_id``.

The mocker samples random tokens, so a reply ends at ``max_output_tokens`` (``incomplete``) unless
it happens to sample EOS (``completed``): the tests accept either and check what each implies.
"""

from __future__ import annotations

import openai
import pytest

from tests.integration.frontend.test_frontend_support import cluster_fixture, openai_fixture

pytestmark = pytest.mark.timeout(180)


cluster = cluster_fixture("responses-cluster", workers=1)
api = openai_fixture(30)


def _check_finished(response: openai.types.responses.Response, limit: int) -> None:
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == limit
    else:
        assert response.usage.output_tokens <= limit
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_unary_and_a_chained_conversation(api: openai.OpenAI) -> None:
    first = api.responses.create(model="tiny", input="Tell me a story", instructions="Be brief", max_output_tokens=12,
                                 extra_body={"ignore_eos": True})
    assert first.status == "incomplete" and first.usage.output_tokens == 12
    assert first.output[0].type == "message" and first.output_text
    _check_finished(first, 12)

    second = api.responses.create(model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=8)
    _check_finished(second, 8)
    # The second prompt holds the first turn (without its instructions): longer than the first.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert api.responses.retrieve(second.id).id == second.id

    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    assert info.value.code == "previous_response_not_found"


def test_streaming_events(api: openai.OpenAI) -> None:
    stream = api.responses.create(model="tiny", input="Stream please", max_output_tokens=20, stream=True,
                                  extra_body={"ignore_eos": True})
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text and final.usage.output_tokens == 20

    with api.responses.stream(model="tiny", input="Helper", max_output_tokens=6) as helper:
        kinds = [e.type for e in helper]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
