"""Prompt-lookup drafts (`replicas.engine.spec.ngram`, `speculation.Drafter`): the longest
recurring suffix, its newest earlier occurrence, bounded, and the same however the
sequence arrived."""

from __future__ import annotations

import random

import pytest

from replicas.engine.config import SpeculativeConfig
from replicas.engine.spec.ngram import NgramIndex
from replicas.engine.sampling.rejection import accepted
from replicas.engine.spec.drafter import PROBE_EVERY, Drafter


def index(tokens: list[int], **config: int) -> NgramIndex:
    built = NgramIndex(SpeculativeConfig(**config))
    built.extend(tokens)
    return built


def test_the_tokens_after_the_suffixs_earlier_occurrence() -> None:
    assert index([1, 2, 3, 4, 5, 9, 1, 2, 3]).draft(4) == [4, 5, 9, 1]


def test_the_longest_suffix_wins_over_a_newer_shorter_one() -> None:
    # "2 3" last occurred before 7, but "1 2 3" only before 4.
    tokens = [1, 2, 3, 4, 0, 2, 3, 7, 0, 1, 2, 3]
    assert index(tokens, prompt_lookup_max=3, prompt_lookup_min=2).draft(2) == [4, 0]


def test_the_newest_occurrence_of_the_same_suffix() -> None:
    tokens = [5, 6, 1, 0, 5, 6, 2, 0, 5, 6]
    assert index(tokens).draft(1) == [2]


def test_a_loop_is_followed_around_past_the_newest_token() -> None:
    # "9 9" last ended one position back: the sequence repeats 9 with period 1.
    assert index([4, 9, 9, 9]).draft(4) == [9, 9, 9, 9]
    # "5 6" ended three back: the continuation is the loop 7 5 6, around again.
    assert index([1, 5, 6, 7, 5, 6]).draft(5) == [7, 5, 6, 7, 5]


def test_nothing_below_the_shortest_suffix_and_bounded_by_the_limit() -> None:
    assert index([1, 2, 3, 1], prompt_lookup_min=2).draft(4) == []
    assert index([1, 2, 3, 1], prompt_lookup_min=1).draft(4) == [2, 3, 1, 2]
    assert index([1, 2, 3, 1], prompt_lookup_min=1).draft(1) == [2]
    assert index([1, 2, 3, 1], prompt_lookup_min=1).draft(0) == []
    assert index([]).draft(4) == []


def test_growing_token_by_token_drafts_as_building_at_once() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    grown = NgramIndex(SpeculativeConfig(prompt_lookup_min=1))
    for at, token in enumerate(tokens):
        grown.extend([token])
        assert grown.draft(4) == index(tokens[:at + 1], prompt_lookup_min=1).draft(4)


def test_a_drafter_follows_what_the_cache_holds_and_forgets_rows_that_left() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    history = [7, 8, 9, 4, 7]
    assert drafter.draft(uid=1, history=history, pending=8, budget=10) == [9, 4, 7]
    # The pass kept 8 and two drafts; the target's next token is now pending.
    history += [8, 9, 4]
    assert drafter.draft(uid=1, history=history, pending=5, budget=10) == []
    assert drafter.draft(uid=1, history=history + [5], pending=7, budget=1) == [8]
    drafter.keep([2])
    assert drafter.draft(uid=1, history=[1], pending=1, budget=3) == [1, 1, 1]  # fresh


@pytest.mark.parametrize(("drafts", "sampled", "kept"), [
    ([[4, 5, 6]], [[4, 5, 6, 7]], [3]),
    ([[4, 5, 6]], [[4, 9, 6, 7]], [1]),
    ([[4, 5, 6]], [[1, 5, 6, 7]], [0]),
    ([[], [4]], [[3, 3], [4, 2]], [0, 1]),
])
def test_kept_drafts_stop_at_the_first_the_target_did_not_sample(
        drafts: list[list[int]], sampled: list[list[int]], kept: list[int]) -> None:
    assert accepted(drafts, sampled) == kept


def test_config_refuses_an_empty_lookup_range() -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=0)


def test_a_row_whose_drafts_miss_drafts_fewer_rests_and_recovers_when_they_hit() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    history = [1, 2, 3, 4, 5] * 4

    def next_draft(uid: int = 1) -> list[int]:
        """The next pass's draft: the pending token joins the history each time, as a
        pass that kept none of the drafts leaves it."""
        pending = history[-5]
        drafted = drafter.draft(uid=uid, history=history, pending=pending, budget=10)
        history.append(pending)
        return drafted

    assert len(next_draft()) == 4
    for _ in range(2):
        drafter.observe(1, drafted=4, kept=0)
    assert len(next_draft()) == 1  # a quarter kept of late: one draft
    drafter.observe(1, drafted=1, kept=0)
    # Nearly nothing kept: the row rests (plain steps), but probes every PROBE_EVERY.
    lengths = []
    for _ in range(2 * PROBE_EVERY):
        lengths.append(len(next_draft()))
        drafter.observe(1, drafted=lengths[-1], kept=0)
    assert lengths == ([0] * (PROBE_EVERY - 1) + [1]) * 2
    for _ in range(3):
        drafter.observe(1, drafted=1, kept=1)  # the probes hit: it drafts again
    assert len(next_draft()) == 4
    drafter.observe(2, drafted=0, kept=0)  # a pass without drafts teaches nothing
    assert len(drafter.draft(uid=2, history=[7, 8, 7], pending=8, budget=10)) == 4
