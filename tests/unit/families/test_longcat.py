"""LongCat's family (`longcat` calls, GLM's layout with its own tags; `longcat_think`
reasoning): its markup through the output pipeline and mlx-lm's parser, its grammar
(`suite.py`), detection, reasoning, random markup.
"""

from __future__ import annotations

from replicas.families.registry import (
    detect_channel_format,
    detect_tool_format,
    get_channel_format,
)
from replicas.pipeline.channels import initial_state
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.reasoning import A, R, splits_at_every_boundary
from tests.unit.families.suite import grammar_tests, markup_tests
from tests.unit.test_tool_calls import Sample, random_markup_test

WEATHER = '{"city": "Paris", "days": 3}'
SCHEMA = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}
LONGCAT_CALL = ("<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
                "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days"
                "</longcat_arg_key>\\n<longcat_arg_value>3</longcat_arg_value>\n"
                "</longcat_tool_call>")

SAMPLES: list[Sample] = [
    # `<longcat_think>` reasoning, GLM's layout with its own tags
    Sample("longcat_think", "longcat", "<longcat_think>\nWeather.\n</longcat_think>\n\n"
           + LONGCAT_CALL, "Weather.", "", (("get_weather", WEATHER),), schemas=SCHEMA),
    Sample("none", "longcat", "<longcat_tool_call>note<longcat_arg_key>text</longcat_arg_key>"
           "<longcat_arg_value>END here</longcat_arg_value></longcat_tool_call>",
           calls=(("note", '{"text": "END here"}'),), stops=("END",)),
    Sample("longcat_think", "longcat", "<longcat_think>\n" + LONGCAT_CALL
           + "\n</longcat_think>\n\nNo.", LONGCAT_CALL, "No.", literal=True),
    Sample("none", "longcat", "<longcat_tool_call><longcat_arg_key>a</longcat_arg_key>"
           "</longcat_tool_call>", answer="<longcat_tool_call><longcat_arg_key>a"
           "</longcat_arg_key></longcat_tool_call>", literal=True),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "longcat")


def test_detect_from_template() -> None:
    # The text mlx-lm's `_infer_tool_parser` detects the family by.
    assert detect_tool_format("<longcat_tool_call>{{ name }}<longcat_arg_key>", []) == "longcat"


def test_reasoning_is_detected_as_mlx_lm_does() -> None:
    vocab = {"<longcat_think>", "</longcat_think>"}
    assert detect_channel_format(None, vocab) == "longcat_think"


def test_reasoning_markup_splits_at_every_boundary() -> None:
    splits_at_every_boundary("longcat_think", "<longcat_think>\nPlan.\n</longcat_think>\n\nAnswer",
                             [(R, "Plan."), (A, "Answer")])


def test_prompt_opened_reasoning() -> None:
    assert initial_state(get_channel_format("longcat_think"), "<longcat_think>\n") == "reasoning"


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("longcat_think", "longcat")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup the parser would still read.
MALFORMED = ["<longcat_tool_call>f<longcat_arg_key>a</longcat_arg_key>1</longcat_tool_call>",
             "<longcat_tool_call>f<longcat_arg_value>1</longcat_arg_value>"
             "</longcat_tool_call>"]

(test_grammar_refuses_malformed_markup, test_what_the_grammar_writes_the_parser_reads,
 test_named_choice_forces_that_tool) = grammar_tests("longcat", MALFORMED, "longcat_think")
