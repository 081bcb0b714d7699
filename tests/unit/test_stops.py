"""Stop matcher: streaming equals one-shot equals a naive reference, for every split."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.contract import FinishReason
from replicas.pipeline.stops import StopMatcher, StopOutput, merge_stops


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Cut at the earliest-ending stop; on a tie the longest (earliest-starting) one."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            stop = max(hits, key=len)
            cut = end if include else end - len(stop)
            return text[:cut], stop
    return text, None


def expected_held(consumed: str, stops: Sequence[str]) -> str:
    for size in range(min(len(consumed), max(map(len, stops)) - 1), 0, -1):
        tail = consumed[-size:]
        if any(s.startswith(tail) and s != tail for s in stops):
            return tail
    return ""


def run(
    text: str, stops: Sequence[str], cuts: Sequence[int], include: bool = False
) -> tuple[str, str | None]:
    """Feed `text` split at `cuts`, checking every invariant after every chunk."""
    want, want_match = reference(text, stops, include)
    matcher = StopMatcher(stops, include_in_output=include)
    longest = max(map(len, stops))
    emitted, consumed = "", ""
    bounds = [0, *cuts, len(text)]
    for lo, hi in pairwise(bounds):
        out = matcher.feed(text[lo:hi])
        emitted += out.text
        consumed += text[lo:hi]
        assert want.startswith(emitted)  # never retracted: always a prefix of the final text
        if out.matched is not None:
            assert out.matched == matcher.matched
            with pytest.raises(RuntimeError):
                matcher.feed("x")
            break
        assert len(matcher.held) <= longest - 1
        assert matcher.held == expected_held(consumed, stops)
        assert emitted + matcher.held == consumed
    else:
        emitted += matcher.finish(FinishReason.LENGTH)
    body = emitted[: len(emitted) - len(want_match)] if include and want_match else emitted
    assert not any(s in body for s in stops)
    assert (emitted, matcher.matched) == (want, want_match)
    return emitted, matcher.matched


def one_shot(text: str, stops: Sequence[str], include: bool = False) -> tuple[str, str | None]:
    matcher = StopMatcher(stops, include_in_output=include)
    out = matcher.feed(text)
    rest = "" if out.matched else matcher.finish(FinishReason.EOS)
    return out.text + rest, out.matched


ALPHABET = "ab3.\n*<>/l`i こんにちは"


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[str], list[int], bool]:
    text = draw(st.text(alphabet=ALPHABET, max_size=40) | st.text(max_size=30))
    pieces = st.text(alphabet=ALPHABET, min_size=1, max_size=5)
    if text:
        # Substrings of the text make matches (and near-matches) common.
        span = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6))
        pieces |= span.map(lambda s: text[s[0] : s[0] + s[1]])
    stops = draw(st.lists(pieces, min_size=1, max_size=6))
    cut_points = st.integers(1, max(1, len(text) - 1))
    cuts = sorted(draw(st.sets(cut_points, max_size=8))) if len(text) > 1 else []
    return text, stops, cuts, draw(st.booleans())


@settings(max_examples=600, deadline=None)
@given(cases())
def test_streaming_matches_reference_for_random_splits(
    case: tuple[str, list[str], list[int], bool],
) -> None:
    text, stops, cuts, include = case
    assert run(text, stops, cuts, include) == one_shot(text, stops, include)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_character_by_character(case: tuple[str, list[str], list[int], bool]) -> None:
    text, stops, _, include = case
    run(text, stops, list(range(1, len(text))), include)


EXAMPLES = [
    ("1. New York\n2. London\n3. Paris\n4. Rome", ["3."]),
    ("Line one\nLine two", ["\n"]),
    ("Para one.\nstill one\n\nPara two", ["\n\n"]),
    ("Some **bold** text", ["**"]),
    ("<ul><li>a</li><li>b</li></ul>", ["</li>"]),
    ("Code:\n```python\nprint(1)\n```\nDone", ["```"]),
    ("前置き、こんにちは世界", ["こんにちは"]),
    ("ABCDEFGHIJKLMNOPQRSTUVWXYZEND", ["END"]),
    ("one two three END four\n\n## five", ["END", "\n\n", "##", "three"]),
    ("xxabyy", ["b", "ab"]),
    ("aaab", ["aab", "aaab", "b"]),
    ("no stop here at all", ["STOP", "\n\n", "</s>", "zz"]),
]


@pytest.mark.parametrize(("text", "stops"), EXAMPLES)
@pytest.mark.parametrize("include", [False, True])
def test_every_one_and_two_cut_split(text: str, stops: list[str], include: bool) -> None:
    whole = one_shot(text, stops, include)
    for n_cuts in (1, 2):
        for cuts in combinations(range(1, len(text)), n_cuts):
            assert run(text, stops, cuts, include) == whole


@pytest.mark.parametrize(
    ("text", "stops", "want"),
    [
        # Seed reports: "3." must cut at item 3, not item 2 or at the first "."
        ("1. Mercury\n2. Venus\n3. Earth\n", ["3."], ("1. Mercury\n2. Venus\n", "3.")),
        ("a\nb", ["\n"], ("a", "\n")),
        ("a\nb\n\nc", ["\n\n"], ("a\nb", "\n\n")),
        ("x **y**", ["**"], ("x ", "**")),
        ("<li>one</li>", ["</li>"], ("<li>one", "</li>")),
        ("say ```js", ["```"], ("say ", "```")),
        ("はい、こんにちは！", ["こんにちは"], ("はい、", "こんにちは")),
        # Four stops at once: the earliest-ending wins, not the first listed.
        ("alpha beta\ngamma.", [".", "\n", "beta", "gamma"], ("alpha ", "beta")),
        # Tie at the same end: the longest (earliest-starting) stop is the match.
        ("xab", ["b", "ab"], ("x", "ab")),
        ("xab", ["ab", "b"], ("x", "ab")),
        # Earliest end beats earliest start: "bc" ends before "abcd" does.
        ("abcd", ["abcd", "bc"], ("a", "bc")),
    ],
)
def test_targeted(text: str, stops: list[str], want: tuple[str, str]) -> None:
    assert one_shot(text, stops) == want
    assert run(text, stops, list(range(1, len(text)))) == want


def test_multi_token_stop_never_leaks_its_start() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("XYZ") == StopOutput("XYZ")
    assert matcher.feed("E") == StopOutput("")
    assert matcher.held == "E"
    assert matcher.feed("ND tail") == StopOutput("", "END")


def test_held_text_is_released_once_it_cannot_match() -> None:
    matcher = StopMatcher(["</li>"])
    assert matcher.feed("a </l") == StopOutput("a ")
    assert matcher.feed("x") == StopOutput("</lx")
    assert matcher.finish(FinishReason.EOS) == ""


def test_include_in_output_emits_the_stop_and_nothing_after() -> None:
    matcher = StopMatcher(["\n\n"], include_in_output=True)
    assert matcher.feed("one\n") == StopOutput("one")
    assert matcher.feed("\ntwo") == StopOutput("\n\n", "\n\n")


def test_finish_flushes_or_discards_held_text() -> None:
    for reason in (FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP_TOKEN):
        matcher = StopMatcher(["STOP"])
        assert matcher.feed("abc ST") == StopOutput("abc ")
        assert matcher.finish(reason) == "ST"
        with pytest.raises(RuntimeError):
            matcher.feed("x")
    cancelled = StopMatcher(["STOP"])
    cancelled.feed("abc ST")
    assert cancelled.finish(FinishReason.CANCELLED) == ""
    with pytest.raises(ValueError):
        StopMatcher(["STOP"]).finish(FinishReason.STOP_SEQUENCE)


def test_no_stops_is_passthrough() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything\n\n") == StopOutput("anything\n\n")
    assert matcher.held == ""
    assert matcher.finish(FinishReason.EOS) == ""


def test_duplicate_stops_report_the_given_string() -> None:
    assert one_shot("a.b", [".", "."]) == ("a", ".")


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None]])
def test_invalid_stops_are_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        StopMatcher(bad)  # type: ignore[arg-type]


def test_merge_stops_keeps_order_and_drops_duplicates() -> None:
    assert merge_stops(["</s>", "\n\n"], ["3.", "</s>", "3.", "x"]) == ("</s>", "\n\n", "3.", "x")
    assert merge_stops([], []) == ()
