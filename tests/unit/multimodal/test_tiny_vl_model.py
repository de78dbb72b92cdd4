"""The built-in ``tiny-vl`` model: its shipped files are what daemon/models/tiny_vl.py builds from
``tiny``'s, it resolves like ``tiny``, and its tokenizer and template serve images."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from dynamod.daemon.frontend.preprocess.chat_template import ChatTemplate
from dynamod.daemon.models import TINY_VL_MODEL_DIR, resolve_model
from dynamod.daemon.models.tiny_vl import IMAGE_PAD, VISION_END, VISION_START, build
from dynamod.shared.runtime.model_files import BUNDLE_FILE_NAMES


def test_shipped_files_are_the_generated_ones() -> None:
    for name, text in build().items():
        assert (TINY_VL_MODEL_DIR / name).read_text(encoding="utf-8") == text, f"re-run python -m dynamod.daemon.models.tiny_vl ({name})"


def test_resolves_with_the_added_tokens() -> None:
    model = resolve_model("tiny-vl")
    assert model.name == "tiny-vl" and model.vocab_size == 4099 and model.context_length == 8192
    tok = Tokenizer.from_file(str(model.tokenizer_path))
    assert [tok.token_to_id(t) for t in (VISION_START, VISION_END, IMAGE_PAD)] == [4096, 4097, 4098]
    assert tok.encode("a" + IMAGE_PAD + "b", add_special_tokens=False).ids.count(4098) == 1
    config = json.loads((TINY_VL_MODEL_DIR / "config.json").read_text())
    assert config["image_token_id"] == 4098 and config["vision_config"]["spatial_merge_size"] == 2
    # The frontend gets the image processor's file through the model-files bundle.
    assert "preprocessor_config.json" in BUNDLE_FILE_NAMES


def test_template_renders_image_parts() -> None:
    model = resolve_model("tiny-vl")
    template = ChatTemplate.from_model(model)
    assert template is not None
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    text = template.render(messages, images=True)
    assert "see" + VISION_START + IMAGE_PAD + VISION_END in text
    assert template.render([{"role": "user", "content": "plain"}]) == resolve_tiny_render("plain")


def resolve_tiny_render(content: str) -> str:
    tiny = ChatTemplate.from_model(resolve_model("tiny"))
    assert tiny is not None
    return tiny.render([{"role": "user", "content": content}])
