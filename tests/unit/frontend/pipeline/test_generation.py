"""Token stream -> text deltas: whole characters only, stop strings across chunk boundaries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamod.daemon.frontend.pipeline.generation import TextGeneration
from dynamod.daemon.frontend.preprocess import IncrementalDetokenizer, Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.errors import EngineError


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TINY_MODEL_DIR)


class FakeEngine:
    """Stands in for EngineStream: one frame per token, the last with a finish reason."""

    def __init__(self, frames: list[dict[str, Any]]) -> None:
        self._frames = frames
        self.generated: list[int] = []
        self.prompt_len = 3
        self.cached_tokens = 0
        self.closed = False
        self._it = self._run()

    async def _run(self) -> AsyncIterator[dict[str, Any]]:
        for frame in self._frames:
            self.generated.extend(frame.get("token_ids", []))
            yield frame

    def __aiter__(self) -> FakeEngine:
        return self

    def __anext__(self) -> Any:
        return self._it.__anext__()

    async def aclose(self) -> None:
        self.closed = True


def _frames(ids: list[int], finish: str = "length") -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = [{"token_ids": [t]} for t in ids]
    frames[-1]["finish_reason"] = finish
    return frames


async def _collect(gen: TextGeneration, token_ids: list[int] | None = None) -> list[tuple[str, str | None]]:
    out = []
    try:
        async for delta in gen:
            out.append((delta.text, delta.finish_reason))
            if token_ids is not None:
                token_ids.extend(delta.token_ids)
    finally:
        await gen.aclose()
    return out


async def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    text = "Hello 🙂 日本語 world"
    ids = tokenizer.encode(text)
    gen = TextGeneration(FakeEngine(_frames(ids)), IncrementalDetokenizer(tokenizer), [], want_logprobs=False)  # type: ignore[arg-type]
    seen: list[int] = []
    deltas = await _collect(gen, seen)
    assert "".join(t for t, _ in deltas) == text
    assert seen == ids  # held-back tokens travel with the next delta
    assert len(deltas) < len(ids)
    assert all("\ufffd" not in t for t, _ in deltas)
    assert deltas[-1][1] == "length"
    assert gen.completion_tokens == len(ids)


async def test_stop_string_split_across_tokens_ends_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Thought: go. Observation: done")
    engine = FakeEngine(_frames(ids))
    gen = TextGeneration(engine, IncrementalDetokenizer(tokenizer), ["Observation:"], want_logprobs=False)  # type: ignore[arg-type]
    deltas = await _collect(gen)
    assert "".join(t for t, _ in deltas) == "Thought: go. "
    assert deltas[-1][1] == "stop"
    assert engine.closed  # the engine request is cut short


async def test_held_back_stop_prefix_is_released_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ends with Obs")
    gen = TextGeneration(FakeEngine(_frames(ids)), IncrementalDetokenizer(tokenizer), ["Observation:"], want_logprobs=False)  # type: ignore[arg-type]
    deltas = await _collect(gen)
    assert "".join(t for t, _ in deltas) == "ends with Obs"


async def test_engine_error_finish_raises(tokenizer: Tokenizer) -> None:
    frames = [{"token_ids": [39]}, {"token_ids": [], "finish_reason": "error", "error": "out of memory"}]
    gen = TextGeneration(FakeEngine(frames), IncrementalDetokenizer(tokenizer), [], want_logprobs=False)  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="out of memory"):
        await _collect(gen)


async def test_stop_string_inside_a_multi_token_frame_ends_output_and_count_there(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" alpha beta gamma delta epsilon")
    stop_at = next(i for i in range(1, len(ids) + 1) if "beta" in tokenizer.decode(ids[:i]))
    engine = FakeEngine([{"token_ids": ids, "finish_reason": "length"}])  # everything in one frame
    gen = TextGeneration(engine, IncrementalDetokenizer(tokenizer), ["beta"], want_logprobs=False)
    token_ids: list[int] = []
    out = await _collect(gen, token_ids)
    assert "".join(t for t, _ in out) == " alpha "
    assert out[-1][1] == "stop"
    assert token_ids == ids[:stop_at] and gen.completion_tokens == stop_at < len(ids)
