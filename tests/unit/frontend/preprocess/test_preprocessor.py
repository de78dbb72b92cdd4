"""The frontend's per-model preprocessor: prompts from the model card's tokenizer and template."""

from __future__ import annotations

import pytest

from dynamod.daemon.frontend.openai.schema import decode_chat_request
from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor, tokenizer_dir
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.model_card import ModelCard


@pytest.fixture(scope="module")
def pre() -> ModelPreprocessor:
    # Workers publish the tokenizer.json path; the directory works as well.
    card = ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR / "tokenizer.json"))
    return ModelPreprocessor.load(card)


def test_tokenizer_source_may_name_file_or_directory() -> None:
    assert tokenizer_dir(str(TINY_MODEL_DIR / "tokenizer.json")) == TINY_MODEL_DIR
    assert tokenizer_dir(str(TINY_MODEL_DIR)) == TINY_MODEL_DIR


@pytest.mark.parametrize("length", [10, 20_000])  # the long one is encoded on a thread
async def test_encoding_matches_the_tokenizer(pre: ModelPreprocessor, length: int) -> None:
    text = ("In the beginning 🙂 " * (length // 19 + 1))[:length]
    reference = Tokenizer.from_dir(TINY_MODEL_DIR).encode(text, add_special_tokens=True)
    assert await pre.completion_prompt(text) == reference


async def test_chat_prompt_uses_the_template_once_with_one_bos(pre: ModelPreprocessor) -> None:
    req = decode_chat_request(b'{"model":"tiny","messages":[{"role":"user","content":"Hello"}]}')
    ids = await pre.chat_prompt(req)
    bos = pre.tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    text = pre.tokenizer.decode(ids, skip_special_tokens=False)
    assert "Hello" in text and text.rstrip().endswith("<|end_header_id|>")


async def test_token_prompts_are_checked_against_the_vocabulary(pre: ModelPreprocessor) -> None:
    assert await pre.completion_prompt([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(InvalidRequestError):
        await pre.completion_prompt([pre.vocab_size])
