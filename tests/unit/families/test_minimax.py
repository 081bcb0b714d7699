"""MiniMax-M2's family (`minimax_m2` calls, `<think>` reasoning): its markup through the
output pipeline and mlx-lm's parser (`suite.py`), detection, random markup, the grammar
refusing near misses and ending raw strings at their close tag.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replicas.contract import FinishReason, ToolChoice
from replicas.families.registry import detect_channel_format, detect_tool_format
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.suite import markup_tests
from tests.unit.families.schemas import LOOSE
from tests.unit.test_guided_tools import (VARIANTS, accepts, call_text, grammar, refuses_malformed,
                                          section)
from tests.unit.test_tool_calls import Sample, random_markup_test

LENGTH = FinishReason.LENGTH
MINIMAX_CALLS = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
                 'Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
                 '<invoke name="ping">\n</invoke>\n</minimax:tool_call>')
WEATHER = '{"city": "Paris", "days": 3}'
WEATHER_SCHEMA = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}

SAMPLES: list[Sample] = [
    # MiniMax-M2 reasons in `<think>` tags
    Sample("think_tags", "minimax_m2", "<think>\nWeather.\n</think>\n\n" + MINIMAX_CALLS,
           "Weather.", "", (("get_weather", WEATHER), ("ping", "{}")),
           schemas=WEATHER_SCHEMA),
    Sample("none", "minimax_m2", "Sure. <minimax:tool_call>\n<invoke name=get_weather>\n"
           "<parameter name='city'>\n  STOP Paris\n</parameter>\n</invoke>\n"
           "</minimax:tool_call>", answer="Sure. ", calls=(("get_weather",
           '{"city": "STOP Paris"}'),), stops=("STOP",)),
    Sample("none", "minimax_m2", "<minimax:tool_call>\nhello\n</minimax:tool_call>",
           answer="<minimax:tool_call>\nhello\n</minimax:tool_call>", literal=True),
    Sample("none", "minimax_m2", MINIMAX_CALLS[:-60], calls=(("get_weather", WEATHER),),
           reason=LENGTH),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "minimax_m2")


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The text mlx-lm's `_infer_tool_parser` detects the family by.
        ("<minimax:tool_call>\n<invoke name=\"{{ tc.name }}\">\n<parameter name=", [],
         "minimax_m2"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


def test_minimax_reasons_in_think_tags() -> None:
    vocab = {"<think>", "</think>", "<minimax:tool_call>"}
    assert detect_channel_format(None, vocab) == "think_tags"


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("think_tags", "minimax_m2")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup, and an unquoted name the parser would still
# read but the grammar never writes.
MALFORMED = ["<minimax:tool_call>\n<invoke name=f>\n</invoke>\n</minimax:tool_call>",
             '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">x</parameter>'
             "\n</invoke>\n</minimax:tool_call>"]


@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(tok: str) -> None:
    refuses_malformed("minimax_m2", tok, LOOSE, MALFORMED)


def test_raw_string_values_end_at_their_close_tag() -> None:
    g = grammar("minimax_m2", ToolChoice("required"), tools=(LOOSE,))
    text = call_text("minimax_m2", "f", {"b": "New\nYork <b>&</b>"})
    assert accepts(g, section("minimax_m2", text))
    assert not accepts(g, section("minimax_m2", call_text("minimax_m2", "f", {"a": "one"})))
