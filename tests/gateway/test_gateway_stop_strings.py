"""StopStringMatcher: the emitted text never contains a stop string, and no text is lost."""

from __future__ import annotations

import random

import pytest

from services.gateway.openai_api.stop_strings import StopStringMatcher


def run(stops, pieces):
    matcher = StopStringMatcher(list(stops))
    out = [matcher.feed(p) for p in pieces]
    if not matcher.stopped:
        out.append(matcher.flush())
    return out, matcher


def test_stop_split_across_pieces_is_never_emitted():
    out, m = run(["STOP"], ["abc S", "T", "O", "P tail"])
    assert "".join(out) == "abc "
    assert out[:3] == ["abc ", "", ""]  # "S", "ST", "STO" held back
    assert m.stopped and m.matched == "STOP"


def test_partial_prefix_released_when_it_does_not_continue():
    out, m = run(["STOP"], ["abc ST", "ORY"])
    assert out == ["abc ", "STORY", ""]
    assert not m.stopped


def test_held_tail_released_at_flush():
    out, m = run(["STOP"], ["the end ST"])
    assert out == ["the end ", "ST"]


def test_earliest_of_several_stops_wins():
    out, m = run(["world", "lo"], ["hello world"])
    assert "".join(out) == "hel"
    assert m.matched == "lo"


def test_stop_at_very_start_and_nothing_after_stop():
    out, m = run(["###"], ["###", "more"])
    assert out == ["", ""]


def test_no_stops_passes_through():
    out, m = run([], ["a", "b"])
    assert out == ["a", "b", ""]


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_equal_whole_text_truncation(seed):
    rng = random.Random(seed)
    alphabet = "ab<|>\n 界😀"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["<|>", "b\nb", "界😀a", "zz"]
    cuts = sorted(rng.sample(range(1, len(text)), 10))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    out, m = run(stops, pieces)
    found = [text.find(s) for s in stops if s in text]
    expected = text[: min(found)] if found else text
    assert "".join(out) == expected
    assert m.stopped == bool(found)
    assert not any(s in "".join(out) for s in stops)
