"""MiniCPM5's family (`minicpm5`: bare `<function>` blocks, CDATA values): its markup
through the output pipeline and mlx-lm's parser, its grammar (`suite.py`), detection,
random markup.
"""

from __future__ import annotations

from replicas.contract import FinishReason
from replicas.families.registry import detect_tool_format
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.suite import grammar_tests, markup_tests
from tests.unit.test_tool_calls import Sample, random_markup_test

LENGTH = FinishReason.LENGTH
SCHEMA = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}
MINICPM5_CALLS = ('<function name="get_weather"><param name="city"><![CDATA[ New\n<York> ]]>'
                  '</param><param name="days"> 3 </param></function>\n'
                  '<function name="ping"></function>')

SAMPLES: list[Sample] = [
    # `<think>` reasoning, bare `<function>` blocks, CDATA values
    Sample("think_tags", "minicpm5", "<think>\nWeather.\n</think>\n\n" + MINICPM5_CALLS,
           "Weather.", "", (("get_weather", '{"city": " New\\n<York> ", "days": 3}'),
                            ("ping", "{}")), schemas=SCHEMA),
    Sample("none", "minicpm5", "<function name=get_weather><param name='city'>STOP Paris"
           "</param></function>", calls=(("get_weather", '{"city": "STOP Paris"}'),),
           stops=("STOP",), schemas=SCHEMA),
    Sample("none", "minicpm5", "<function name=>x</function>",
           answer="<function name=>x</function>", literal=True),
    Sample("none", "minicpm5", '<function name="f"><param name="q">half',
           calls=(("f", '{"q": "half"}'),), reason=LENGTH),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "minicpm5")


def test_detect_from_template() -> None:
    # The texts mlx-lm's `_infer_tool_parser` detects the family by.
    assert detect_tool_format('<function name="{{ n }}"><param name="{{ p }}">', []) == "minicpm5"


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("none", "minicpm5")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup, and spellings the parser still reads but
# the grammar never writes.
MALFORMED = ["<function name=f></function>", '<function name="f"><param name="a">x'
             "</param></function>"]

# Raw text is stripped by the reference: a newline inside a string stays, so it is skipped.
(test_grammar_refuses_malformed_markup, test_what_the_grammar_writes_the_parser_reads,
 test_named_choice_forces_that_tool) = grammar_tests(
    "minicpm5", MALFORMED, "none", keep=lambda args: "\n" not in args.get("b", ""))
