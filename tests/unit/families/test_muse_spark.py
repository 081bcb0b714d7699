"""Muse Spark's family (`muse_spark`: MiniMax-M2's layout with `atem:` tags, values JSON
when they parse): its markup through the output pipeline and mlx-lm's parser, its grammar
(`suite.py`), detection, random markup.
"""

from __future__ import annotations

from replicas.families.registry import detect_tool_format
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.suite import grammar_tests, markup_tests
from tests.unit.test_tool_calls import Sample, random_markup_test

MUSE_CALLS = ('<atem:function_calls>\n<atem:invoke name="get_weather">\n'
              '<atem:parameter name="city">Paris</atem:parameter>\n'
              '<atem:parameter name="days">3</atem:parameter>\n'
              '<atem:parameter name="note">"a STOP b"</atem:parameter>\n</atem:invoke>\n'
              '<atem:invoke name="ping">\n</atem:invoke>\n</atem:function_calls>')

SAMPLES: list[Sample] = [
    # values are JSON when they parse
    Sample("none", "muse_spark", "Checking. " + MUSE_CALLS, answer="Checking. ",
           calls=(("get_weather", '{"city": "Paris", "days": 3, "note": "a STOP b"}'),
                  ("ping", "{}")), stops=("STOP",)),
    Sample("none", "muse_spark", '<atem:function_calls><atem:invoke id="7" name="f">'
           '<atem:parameter type="x" name="q">[1, 2]</atem:parameter></atem:invoke>'
           "</atem:function_calls>", calls=(("f", '{"q": [1, 2]}'),)),
    Sample("none", "muse_spark", "<atem:function_calls>hello</atem:function_calls>",
           answer="<atem:function_calls>hello</atem:function_calls>", literal=True),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "muse_spark")


def test_detect_from_template() -> None:
    # The text mlx-lm's `_infer_tool_parser` detects the family by.
    assert detect_tool_format("<atem:function_calls>\n<atem:invoke name=", []) == "muse_spark"


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("none", "muse_spark")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: a value that breaks the schema.
MALFORMED = ['<atem:function_calls>\n<atem:invoke name="f">\n<atem:parameter name="b">x'
             "</atem:parameter>\n</atem:invoke>\n</atem:function_calls>"]

(test_grammar_refuses_malformed_markup, test_what_the_grammar_writes_the_parser_reads,
 test_named_choice_forces_that_tool) = grammar_tests("muse_spark", MALFORMED, "none")
