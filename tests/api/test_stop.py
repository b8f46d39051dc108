"""Stop strings: matched across deltas, never sent in part, and the text before them kept."""

from __future__ import annotations

import pytest

from jax_llm_runtime.runtime.text.stop_strings import StopStringMatcher


def feed_all(stop: tuple[str, ...], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stop)
    out = [matcher.feed(p) for p in pieces]
    if not matcher.stopped:
        out.append(matcher.flush())
    return out, matcher.stopped


def test_no_stop_strings_pass_text_through() -> None:
    assert feed_all((), ["a", "b"]) == (["a", "b", ""], False)


def test_match_across_deltas_holds_back_only_possible_prefixes() -> None:
    out, stopped = feed_all(("END",), ["abE", "N", "xEN", "D", "more"])
    assert out == ["ab", "", "ENx", "", ""]
    assert stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    out, stopped = feed_all(("cd", "b"), ["abcd"])
    assert out == ["a"] and stopped


def test_held_text_is_flushed_at_the_end() -> None:
    assert feed_all(("xyz",), ["ax", "y"]) == (["a", "", "xy"], False)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(("",))
