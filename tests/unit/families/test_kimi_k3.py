"""Kimi K3's family (`kimi_k3` calls tied to the `xtml` channel format): its markup through
the output pipeline and mlx-lm's parser, its grammar (`suite.py`), detection by the XTML
vocabulary, reasoning, random markup, the answer wrapper under `auto`.
"""

from __future__ import annotations

import pytest

from replicas.contract import FinishReason, ToolChoice
from replicas.families.registry import (
    detect_channel_format,
    detect_tool_format,
    get_channel_format,
)
from replicas.pipeline.channels import initial_state
from tests.unit.families.fragments import EXAMPLES, FRAGMENTS
from tests.unit.families.reasoning import A, R, splits_at_every_boundary
from tests.unit.families.suite import grammar_tests, markup_tests
from tests.unit.test_guided_tools import VARIANTS, accepts, call_text, grammar, section
from tests.unit.test_tool_calls import Sample, random_markup_test

LENGTH = FinishReason.LENGTH
XTML_VOCAB = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"}
K3_TYPED = ('<|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|> Tokyo &amp; co<|close|>argument'
            '<|sep|><|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
            '<|close|>call<|sep|>')
K3_JSON = ('<|open|>call tool="get_time" index="2"<|sep|><|open|>json type="object"<|sep|>'
           '{"tz": "CET", "n": [1, {"x": "}"}]}<|close|>json<|sep|><|close|>call<|sep|>')
K3_SECTION = "<|open|>tools<|sep|>{}<|close|>tools<|sep|>"

SAMPLES: list[Sample] = [
    # XTML reasoning and answer wrapper, typed arguments or one JSON block
    Sample("xtml", "kimi_k3", "<|open|>think<|sep|>Need both.<|close|>think<|sep|>"
           "<|open|>response<|sep|>Checking.<|close|>response<|sep|>"
           + K3_SECTION.format(K3_TYPED + K3_JSON) + "<|close|>message<|sep|>",
           "Need both.", "Checking.", (("get_weather", '{"city": " Tokyo &amp; co", "days": 3}'),
                                       ("get_time", '{"tz": "CET", "n": [1, {"x": "}"}]}'))),
    Sample("xtml", "kimi_k3", "<|open|>think<|sep|>" + K3_SECTION.format(K3_TYPED)
           + "<|close|>think<|sep|>No.", K3_SECTION.format(K3_TYPED), "No.", literal=True),
    Sample("xtml", "kimi_k3", K3_SECTION.format('<|open|>call index="1"<|sep|><|close|>call'
                                                "<|sep|>"),
           answer='<|open|>call index="1"<|sep|><|close|>call<|sep|>', literal=True),
    Sample("xtml", "kimi_k3", K3_SECTION.format(K3_JSON).split(': "}"')[0],
           calls=(("get_time", '{"tz": "CET", "n": [1, {"x"'),), reason=LENGTH),
]
(test_one_shot_and_every_split_point_agree,
 test_calls_match_mlx_lm_reference_parser) = markup_tests(SAMPLES, "kimi_k3")


def test_detected_by_the_xtml_vocabulary_as_mlx_lm_does() -> None:
    assert detect_tool_format(None, XTML_VOCAB) == "kimi_k3"
    assert detect_channel_format(None, XTML_VOCAB) == "xtml"


def test_reasoning_markup_splits_at_every_boundary() -> None:
    splits_at_every_boundary(
        "xtml", "<|open|>think<|sep|>Plan.<|close|>think<|sep|><|open|>response<|sep|>Answer"
                "<|close|>response<|sep|><|close|>message<|sep|>", [(R, "Plan."), (A, "Answer")])


def test_prompt_opened_reasoning() -> None:
    prompt = "<|open|>assistant<|sep|><|open|>think<|sep|>"
    assert initial_state(get_channel_format("xtml"), prompt) == "reasoning"


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("xtml", "kimi_k3")], FRAGMENTS, EXAMPLES)


# --- grammar (the canonical calls of every format are in test_guided_tools.py) ---------

# Text the grammar must refuse: the typed form, which the parser reads but the grammar
# never writes.
MALFORMED = ['<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
             '<|open|>argument key="a" type="integer"<|sep|>1<|close|>argument<|sep|>'
             "<|close|>call<|sep|><|close|>tools<|sep|>"]

(test_grammar_refuses_malformed_markup, test_what_the_grammar_writes_the_parser_reads,
 test_named_choice_forces_that_tool) = grammar_tests("kimi_k3", MALFORMED, "xtml")


@pytest.mark.parametrize("tok", VARIANTS)
def test_kimi_k3_auto_lets_the_answer_wrapper_through(tok: str) -> None:
    g = grammar("kimi_k3", ToolChoice("auto"), tok)
    call = section("kimi_k3", call_text("kimi_k3", "get_weather", {"city": "Paris"}))
    wrapped = "<|open|>response<|sep|>Checking.<|close|>response<|sep|>"
    assert accepts(g, wrapped, tok)
    assert accepts(g, wrapped + call, tok)
    assert not accepts(g, wrapped + call.replace("get_weather", "nope"), tok)
