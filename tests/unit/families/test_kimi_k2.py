"""Kimi K2's family (`kimi_k2` calls, `<think>` reasoning): its markup through the output
pipeline and mlx-lm's parser (`suite.py`), detection, the section markers, random markup,
the grammar refusing near misses. `tool_choice: none` is `test_tool_choice_none.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replicas.contract import FinishReason
from replicas.families.registry import TOOL_FORMATS, detect_channel_format, detect_tool_format
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.suite import markup_tests
from tests.unit.families.schemas import LOOSE
from tests.unit.test_guided_tools import VARIANTS, refuses_malformed
from tests.unit.test_tool_calls import (Sample, check, decode, expected,
                                        random_markup_test)

LENGTH = FinishReason.LENGTH
KIMI_WEATHER = ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|>')
KIMI_TIME = ('<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
             '{"tz": "CET", "n": [1, {"x": "}"}]}<|tool_call_end|>')
KIMI_SECTION = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"

SAMPLES: list[Sample] = [
    # K2 Thinking reasons in `<think>` tags
    Sample("think_tags", "kimi_k2", "<think>\nNeed both.\n</think>\n\nChecking.\n"
           + KIMI_SECTION.format(KIMI_WEATHER + KIMI_TIME), "Need both.", "Checking.\n",
           (("get_weather", '{"city": "Paris"}'),
            ("get_time", '{"tz": "CET", "n": [1, {"x": "}"}]}'))),
    Sample("none", "kimi_k2", KIMI_SECTION.format(
           '<|tool_call_begin|> get.v2:7 <|tool_call_argument_begin|> {"q": "STOP"}'
           "<|tool_call_end|>"), calls=(("get.v2", '{"q": "STOP"}'),), stops=("STOP",)),
    Sample("think_tags", "kimi_k2", "<think>\n" + KIMI_WEATHER + "\n</think>\n\nNo.",
           KIMI_WEATHER, "No.", literal=True),
    # Without the `:IDX` the reference finds no call either: the markup is text.
    Sample("none", "kimi_k2", KIMI_SECTION.format(
           "<|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>"),
           answer="<|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
           "<|tool_call_end|>", literal=True),
    Sample("none", "kimi_k2", KIMI_WEATHER, answer=KIMI_WEATHER, names=frozenset({"other"}),
           literal=True),
    Sample("none", "kimi_k2", KIMI_SECTION.format(KIMI_WEATHER).split("is")[0],
           calls=(("get_weather", '{"city": "Par'),), reason=LENGTH),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "kimi_k2")


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The texts mlx-lm's `_infer_tool_parser` detects the family by.
        ("{{ '<|tool_calls_section_begin|>' }}{% for tc in m.tool_calls %}"
         "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>", [], "kimi_k2"),
        (None, {"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<think>"}, "kimi_k2"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


def test_kimi_k2_thinking_reasons_in_think_tags() -> None:
    vocab = {"<think>", "</think>", "<|tool_calls_section_begin|>"}
    assert detect_channel_format(None, vocab) == "think_tags"


def test_section_markers_are_reserved_and_dropped_around_calls() -> None:
    kimi = TOOL_FORMATS["kimi_k2"]
    assert set(kimi.section) <= set(kimi.reserved)
    sample = Sample("none", "kimi_k2", "A" + KIMI_SECTION.format("") + "B", answer="AB")
    assert check(sample, decode(sample, [sample.text])) == expected(sample)


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("think_tags", "kimi_k2")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup the parser would still read.
MALFORMED = ["<|tool_calls_section_begin|><|tool_call_begin|>functions.f"
             '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>',
             "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
             '<|tool_call_argument_begin|>{"a": 1}<|tool_calls_section_end|>']


@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(tok: str) -> None:
    refuses_malformed("kimi_k2", tok, LOOSE, MALFORMED)
