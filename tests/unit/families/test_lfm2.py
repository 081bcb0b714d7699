"""LFM2's family (`pythonic` calls): its markup through the output pipeline and mlx-lm's
parser (`suite.py`), detection, random markup, the grammar refusing near misses and
writing optional arguments in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replicas.contract import FinishReason, ToolChoice
from replicas.families.registry import detect_tool_format
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.suite import markup_tests
from tests.unit.families.schemas import LOOSE, OPEN
from tests.unit.test_guided_tools import (VARIANTS, accepts, call_text, grammar, refuses_malformed,
                                          section)
from tests.unit.test_tool_calls import (Sample, check, decode, expected,
                                        random_markup_test)

LENGTH = FinishReason.LENGTH
PYTHONIC_CALLS = ('<|tool_call_start|>[get_weather(city="Pa,ris)", days=3, opts={"a": [1, (2)], '
                  '"b": true, "c": None}), ping()]<|tool_call_end|>')

SAMPLES: list[Sample] = [
    # Python literals, or JSON's, per keyword argument
    Sample("think_tags", "pythonic", "<think>\nWeather.\n</think>\n\nOk.\n" + PYTHONIC_CALLS,
           "Weather.", "Ok.\n", (("get_weather", '{"city": "Pa,ris)", "days": 3, "opts": '
           '{"a": [1, 2], "b": true, "c": null}}'), ("ping", "{}"))),
    Sample("none", "pythonic", "<|tool_call_start|>[ns.say(text='a STOP b \\' )', ok=True)]"
           "<|tool_call_end|>", calls=(("ns.say", '{"text": "a STOP b \' )", "ok": true}'),),
           stops=("STOP",)),
    Sample("think_tags", "pythonic", "<think>\n" + PYTHONIC_CALLS + "\n</think>\n\nNo.",
           PYTHONIC_CALLS, "No.", literal=True),
    Sample("none", "pythonic", "<|tool_call_start|>print('hi')<|tool_call_end|>",
           answer="<|tool_call_start|>print('hi')<|tool_call_end|>", literal=True),
    Sample("none", "pythonic", "<|tool_call_start|>[f(q='half', r=[1, 2",
           calls=(("f", '{"q": "half"}'),), reason=LENGTH),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "pythonic")


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The texts mlx-lm's `_infer_tool_parser` detects the family by.
        ("{{- '<|tool_call_start|>' }}[{{ tc.name }}(", [], "pythonic"),
        (None, {"<|tool_call_start|>", "<|tool_call_end|>"}, "pythonic"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("none", "pythonic")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup, and spellings the parser would still read
# but the grammar never writes (Python's `'x'` and `True`, arguments out of order).
MALFORMED = ["<|tool_call_start|>[f(1)]<|tool_call_end|>",
             "<|tool_call_start|>[f(, a=1)]<|tool_call_end|>",
             "<|tool_call_start|>[f(b='x')]<|tool_call_end|>",
             "<|tool_call_start|>[f(c=True)]<|tool_call_end|>",
             "<|tool_call_start|>[f(b=\"x\", a=1)]<|tool_call_end|>"]


@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(tok: str) -> None:
    refuses_malformed("pythonic", tok, LOOSE, MALFORMED)


@pytest.mark.parametrize("tok", VARIANTS)
def test_pythonic_writes_optional_arguments_in_order_with_commas_between(tok: str) -> None:
    g = grammar("pythonic", ToolChoice("required"), tok, tools=(LOOSE, OPEN))
    for args in ({}, {"b": "x"}, {"a": 1, "c": True}, {"a": 1, "b": "y, z", "c": False}):
        assert accepts(g, section("pythonic", call_text("pythonic", "f", args)), tok), args
    free = '<|tool_call_start|>[g(x=1, y="s", z=[null])]<|tool_call_end|>'
    assert accepts(g, free, tok)
    # What the grammar writes, the parser reads as the same arguments.
    text = section("pythonic", call_text("pythonic", "f", {"a": 1, "b": "y, z", "c": False}))
    sample = Sample("none", "pythonic", text, calls=(("f", '{"a": 1, "b": "y, z", "c": false}'),))
    assert check(sample, decode(sample, [text])) == expected(sample)
