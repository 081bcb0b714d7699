"""GLM's family (`glm47` calls, `<think>` reasoning): its markup through the output pipeline
and mlx-lm's parser (`suite.py`), detection, random markup, the grammar refusing near
misses and ending raw strings at their close tag.
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
GLM47_CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
GLM45_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
WEATHER = '{"city": "Paris", "days": 3}'

SAMPLES: list[Sample] = [
    # GLM-4.7's compact form and GLM-4.5's lines
    Sample("think_tags", "glm47", "<think>\nWeather.\n</think>\n\nOk.\n" + GLM47_CALL,
           "Weather.", "Ok.\n", (("get_weather", WEATHER),)),
    Sample("none", "glm47", GLM45_CALL + "\n<tool_call>ping</tool_call>",
           calls=(("get_weather", WEATHER), ("ping", "{}"))),
    Sample("none", "glm47", "<tool_call>note<arg_key>text</arg_key><arg_value>END here\nEND"
           "</arg_value><arg_key>n</arg_key><arg_value>7</arg_value><arg_key>xs</arg_key>"
           "<arg_value>[1, 2]</arg_value></tool_call>",
           calls=(("note", '{"text": "END here\\nEND", "n": "7", "xs": [1, 2]}'),),
           stops=("END",), schemas={"note": {"properties": {"n": {"type": "string"}}}}),
    Sample("think_tags", "glm47", "<think>\n" + GLM47_CALL + "\n</think>\n\nNo.",
           GLM47_CALL, "No.", literal=True),
    Sample("none", "glm47", "<tool_call>not a call</tool_call>",
           answer="<tool_call>not a call</tool_call>", literal=True),
    Sample("none", "glm47", "<tool_call><arg_key>a</arg_key></tool_call>",
           answer="<tool_call><arg_key>a</arg_key></tool_call>", literal=True),
    Sample("none", "glm47", "<tool_call>f<arg_key>q</arg_key><arg_value>half",
           calls=(("f", '{"q": "half"}'),), reason=LENGTH),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "glm47")


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The texts mlx-lm's `_infer_tool_parser` detects the family by.
        ("<tool_call>{{ tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key>"
         "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>", [], "glm47"),
        (None, {"<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"}, "glm47"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


def test_glm_reasons_in_think_tags() -> None:
    vocab = {"<think>", "</think>", "<tool_call>", "<arg_key>"}  # GLM-4.5 to 4.7
    assert detect_channel_format(None, vocab) == "think_tags"


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("none", "glm47")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup the parser would still read.
MALFORMED = ["<tool_call>f<arg_key>a</arg_key>1</tool_call>",
             "<tool_call>f<arg_value>1</arg_value></tool_call>"]


@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(tok: str) -> None:
    refuses_malformed("glm47", tok, LOOSE, MALFORMED)


def test_raw_string_values_end_at_their_close_tag() -> None:
    g = grammar("glm47", ToolChoice("required"), tools=(LOOSE,))
    assert accepts(g, section("glm47", call_text("glm47", "f", {"b": "New\nYork <b>&</b>"})))
    assert not accepts(g, section("glm47", call_text("glm47", "f", {"a": "one"})))
