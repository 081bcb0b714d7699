"""Gemma's two families, Gemma 4 (`gemma4` calls and reasoning) and FunctionGemma
(`function_gemma` calls): their markup through the output pipeline and mlx-lm's parsers,
the grammars (`suite.py`), Gemma values, detection, reasoning, random markup.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replicas.contract import Channel, FinishReason
from replicas.families.registry import (
    detect_channel_format,
    detect_tool_format,
    get_channel_format,
)
from replicas.pipeline.channels import initial_state
from replicas.pipeline.tool_calls.gemma_reader import gemma_value
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS, Q
from tests.unit.families.reasoning import A, R, splits_at_every_boundary
from tests.unit.families.suite import grammar_tests, markup_tests
from tests.unit.test_tool_calls import Sample, random_markup_test

LENGTH = FinishReason.LENGTH
GEMMA4_CALL = (f"<|tool_call>call:get_weather{{city:{Q}Pa,ris}}{Q},days:3,"
               f"opts:{{a:[1,{Q}x, y{Q}],b:true,c:null}}}}<tool_call|>")
GEMMA4_ARGS = '{"city": "Pa,ris}", "days": 3, "opts": {"a": [1, "x, y"], "b": true, "c": null}}'
FG_CALL = ("<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3,"
           "unit:c}<end_function_call>")

SAMPLES: list[Sample] = [
    # gemma4: reasoning in `<|channel>thought` ... `<channel|>`
    Sample("gemma4", "gemma4", "<|channel>thought\nWeather.\n<channel|>Ok.\n" + GEMMA4_CALL
           + "<|tool_call>call:ping{}<tool_call|>", "Weather.", "Ok.\n",
           (("get_weather", GEMMA4_ARGS), ("ping", "{}"))),
    Sample("none", "gemma4", f"<|tool_call>call:say{{text:{Q}a STOP, b}}{Q}}}<tool_call|>",
           calls=(("say", '{"text": "a STOP, b}"}'),), stops=("STOP",)),
    Sample("gemma4", "gemma4", "<|channel>thought\n" + GEMMA4_CALL + "<channel|>No.",
           GEMMA4_CALL, "No.", literal=True),
    Sample("none", "gemma4", "<|tool_call>print('hi')<tool_call|>",
           answer="<|tool_call>print('hi')<tool_call|>", literal=True),
    Sample("none", "gemma4", f"<|tool_call>call:f{{q:{Q}half{Q},r:[1,",
           calls=(("f", '{"q": "half"}'),), reason=LENGTH),
    # function_gemma: no reasoning
    Sample("none", "function_gemma", "Sure. " + FG_CALL, answer="Sure. ",
           calls=(("get_weather", '{"city": "Paris", "days": 3, "unit": "c"}'),)),
    Sample("none", "function_gemma", FG_CALL + FG_CALL.replace("Paris", "Rome"),
           calls=(("get_weather", '{"city": "Paris", "days": 3, "unit": "c"}'),
                  ("get_weather", '{"city": "Rome", "days": 3, "unit": "c"}'))),
    Sample("none", "function_gemma", "<start_function_call>hello<end_function_call>",
           answer="<start_function_call>hello<end_function_call>", literal=True),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES)


@pytest.mark.parametrize(("text", "quote", "want"), [
    (f"{Q}a,b{Q}", Q, "a,b"),
    (f"{{k:{Q}v{Q},n:[1,{{m:{Q}}}{Q}}}]}}", Q, {"k": "v", "n": [1, {"m": "}"}]}),
    ('{"k": "x,y:1"}', Q, {"k": "x,y:1"}),  # JSON inside, as the grammar writes it
    ("Paris", "<escape>", "Paris"),  # not JSON: the text (FunctionGemma's reference)
    ("2.5", "<escape>", 2.5),
])
def test_gemma_values(text: str, quote: str, want: object) -> None:
    assert gemma_value(text, quote) == want


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The texts mlx-lm's `_infer_tool_parser` detects each family by.
        ("{{ '<|tool_call>call:' + name }}{{ '<tool_call|>' }}", [], "gemma4"),
        ("{{ '<start_function_call>call:' }}", [], "function_gemma"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


def test_gemma4_reasoning_is_detected_as_mlx_lm_does() -> None:
    assert detect_channel_format(None, {"<|channel>", "<channel|>", "<|tool_call>"}) == "gemma4"


@pytest.mark.parametrize(("text", "want"), [
    ("<|channel>thought\nPlan.\n<channel|>Answer", [(R, "Plan."), (A, "Answer")]),
    ("<|channel>other<channel|>", [(A, "<|channel>other<channel|>")]),
])
def test_reasoning_markup_splits_at_every_boundary(
        text: str, want: list[tuple[Channel, str]]) -> None:
    splits_at_every_boundary("gemma4", text, want)


@pytest.mark.parametrize(("prompt", "want"), [
    ("<|turn>model\n<|channel>thought\n", "reasoning"),
    ("<|turn>model\n<|channel>thought\n<channel|>", "answer_after"),
])
def test_prompt_opened_reasoning(prompt: str, want: str) -> None:
    assert initial_state(get_channel_format("gemma4"), prompt) == want


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("gemma4", "gemma4"), ("none", "function_gemma")], FRAGMENTS, 2 * EXAMPLES)


# --- grammars (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: broken markup, and spellings the parser still reads but
# the grammar never writes.
(test_gemma4_grammar_refuses_malformed_markup, test_gemma4_grammar_writes_what_the_parser_reads,
 test_gemma4_named_choice_forces_that_tool) = grammar_tests("gemma4", [
    "<|tool_call>call:f{a:<|\"|>1<|\"|>}<tool_call|>", "<|tool_call>call:f{b:x}<tool_call|>",
    "<|tool_call>call:f{a:1<tool_call|>"], "gemma4")
(test_function_gemma_grammar_refuses_malformed_markup,
 test_function_gemma_grammar_writes_what_the_parser_reads,
 test_function_gemma_named_choice_forces_that_tool) = grammar_tests("function_gemma", [
    "<start_function_call>call:f{b:x}<end_function_call>",
    "<start_function_call>call:f(a=1)<end_function_call>"], "none")
