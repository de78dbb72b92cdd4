"""Stop strings over streamed deltas: straddling chunks, minimal hold-back, split invariance."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.frontend.preprocess import StopStringMatcher


def run(stops: list[str], chunks: list[str], **kwargs: bool) -> tuple[str, str | None]:
    """Feeds the chunks until a stop; returns (all emitted text, matched stop)."""
    matcher = StopStringMatcher(stops, **kwargs)
    emitted: list[str] = []
    for chunk in chunks:
        text, stop = matcher.feed(chunk)
        emitted.append(text)
        if stop is not None:
            return "".join(emitted), stop
    emitted.append(matcher.flush())
    return "".join(emitted), None


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The stop that completes first in the text (ties: the longer), by brute force."""
    for end in range(1, len(text) + 1):
        candidates = [s for s in stops if s and text[:end].endswith(s)]
        if candidates:
            stop = max(candidates, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_stop_in_one_chunk() -> None:
    assert run(["STOP"], ["Hello world STOP more"]) == ("Hello world ", "STOP")


def test_stop_straddling_chunks() -> None:
    matcher = StopStringMatcher(["Observation:"])
    assert matcher.feed("Thought: go\nObs") == ("Thought: go\n", None)
    assert matcher.held_text == "Obs"
    assert matcher.feed("erva") == ("", None)
    assert matcher.feed("tion: 42") == ("", "Observation:")
    assert matcher.matched == "Observation:"
    assert matcher.feed("later text") == ("", None)
    assert matcher.flush() == ""


def test_only_the_longest_possible_partial_stop_is_held() -> None:
    matcher = StopStringMatcher(["abcX", "zz"])
    assert matcher.feed("xxab") == ("xx", None)
    assert matcher.held_text == "ab"
    assert matcher.feed("c") == ("", None)
    assert matcher.feed("d") == ("abcd", None)  # false alarm: released at once
    assert matcher.feed("z") == ("", None)
    assert matcher.flush() == "z"  # generation ended: nothing can complete it any more


def test_include_stop_string_in_output() -> None:
    assert run(["</s>"], ["answer</", "s> tail"], include_stop_str_in_output=True) == ("answer</s>", "</s>")


def test_earliest_completed_stop_wins() -> None:
    assert run(["abcd", "bc"], ["abcd"]) == ("a", "bc")
    assert run(["abcd", "bc"], ["abc", "d"]) == ("a", "bc")
    assert run(["c", "abc"], ["xabc"]) == ("x", "abc")  # same end: the longer one


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc🎉", max_size=30),
    stops=st.lists(st.text(alphabet="abc🎉", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
    include=st.booleans(),
)
def test_any_split_gives_the_same_result_as_one_chunk(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = run(stops, [text], include_stop_str_in_output=include)
    assert run(stops, chunks, include_stop_str_in_output=include) == whole
    emitted, stop = reference(stops, text)
    expected = (emitted + stop if include and stop is not None else emitted, stop)
    assert whole == expected
    if stop is None or not include:
        assert not any(s in whole[0] for s in stops)
