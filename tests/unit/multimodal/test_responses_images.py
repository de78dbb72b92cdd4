"""The Responses API's ``input_image`` parts become chat ``image_url`` parts that remember their
place in the Responses input, so an image error names ``input[i].content[j]``."""

from __future__ import annotations

import pytest

from dynamod.daemon.frontend.openai.responses.schema import input_messages
from dynamod.daemon.frontend.preprocess.media import collect_images
from dynamod.daemon.frontend.preprocess.media.parts import WHERE_KEY
from dynamod.shared.errors import InvalidRequestError


def test_input_image_becomes_a_chat_image_part() -> None:
    items = [
        {"role": "user", "content": "first turn"},
        {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"}]},
    ]
    messages = input_messages(items)
    assert messages[0] == {"role": "user", "content": "first turn"}  # text-only content stays a string
    text, image = messages[1]["content"]
    assert text == {"type": "text", "text": "look"}
    assert image["image_url"] == {"url": "data:image/png;base64,AA", "detail": "low"}
    assert image[WHERE_KEY] == "input[1].content[1]"
    (ref,) = collect_images(messages, 4)
    assert (ref.where, ref.detail) == ("input[1].content[1]", "low")


def test_input_image_shape_errors_name_the_part() -> None:
    for part, why in (({"type": "input_image", "file_id": "f"}, "file_id images are not supported"),
                      ({"type": "input_image"}, "input_image needs image_url")):
        with pytest.raises(InvalidRequestError, match=r"^input\[0\]\.content\[0\]: " + why):
            input_messages([{"role": "user", "content": [part]}])
    messages = input_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "max"}]}])
    with pytest.raises(InvalidRequestError, match=r"^input\[0\]\.content\[0\]: image_url.detail must be"):
        collect_images(messages, 4)
