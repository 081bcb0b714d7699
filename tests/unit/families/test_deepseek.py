"""DeepSeek V3.1's tool-call format (`deepseek_v31`): parsing, streaming, detection, grammar.

mlx-lm 0.32 has no parser for it, so the reference is the markup its chat template writes
and vLLM's DeepSeek V3.1 parser: each `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
<｜tool▁call▁end｜>` span is a call, NAME the text before the sep, ARGS JSON. As for every
family, each sample runs through the whole output pipeline in one shot, cut at every point
and one character per chunk, all giving the same events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest

from replicas.contract import FinishReason, ToolCallDelta, ToolCallStart, ToolChoice
from replicas.families.deepseek import (
    DEEPSEEK_V31_CALL,
    DEEPSEEK_V31_RESULTS,
    DEEPSEEK_V31_SECTION,
    DEEPSEEK_V31_SEP,
)
from replicas.families.registry import (
    TOOL_FORMATS,
    detect_channel_format,
    detect_tool_format,
    get_channel_format,
)
from replicas.pipeline.channels import initial_state
from tests.unit.test_guided_tools import (LOOSE, ROUND_TRIP, VARIANTS, accepts, call_text, grammar,
                                          named_auto_choice_forces_that_tool, refuses_malformed,
                                          section)
from tests.unit.test_tool_calls import (Sample, check, decode, expected,
                                        one_shot_and_every_split_agree, random_markup_test)

FMT = "deepseek_v31"
LENGTH = FinishReason.LENGTH
BEGIN, END = DEEPSEEK_V31_SECTION
CALL, CALL_END = DEEPSEEK_V31_CALL
SEP = DEEPSEEK_V31_SEP


def ds_call(name: str, arguments: str) -> str:
    return f"{CALL}{name}{SEP}{arguments}{CALL_END}"


WEATHER = '{"city": "Paris"}'
TIME = '{"tz": "CET", "n": [1, {"x": "}<"}]}'
TWO_CALLS = BEGIN + ds_call("get_weather", WEATHER) + ds_call("get_time", TIME) + END

SAMPLES: list[Sample] = [
    # Thinking on: reasoning, a line of answer, then a section of two calls.
    Sample("think_tags", FMT, "<think>\nNeed both.\n</think>\n\nChecking.\n" + TWO_CALLS,
           "Need both.", "Checking.\n", (("get_weather", WEATHER), ("get_time", TIME))),
    # Thinking off (the prompt ends in `</think>`): calls at once, the eos text after ignored.
    Sample("think_tags", FMT, TWO_CALLS + "<\uff5cend\u2581of\u2581sentence\uff5c>",
           calls=(("get_weather", WEATHER), ("get_time", TIME)), state="answer_after"),
    # Stops never fire inside a call; blanks around the name and the JSON are layout.
    Sample("none", FMT, BEGIN + f"{CALL} say \n{SEP}\n" + '{"text": "a STOP b \\" }"}'
           + f"\n{CALL_END}{END}", calls=(("say", '{"text": "a STOP b \\" }"}'),),
           stops=("STOP",)),
    # Markup inside reasoning is reasoning.
    Sample("think_tags", FMT, "<think>\n" + TWO_CALLS + "\n</think>\n\nNo.", TWO_CALLS, "No.",
           literal=True),
    # No sep: not a call (vLLM finds none either); the section markers are still dropped.
    Sample("none", FMT, BEGIN + f"{CALL}get_weather{CALL_END}" + END,
           answer=f"{CALL}get_weather{CALL_END}", literal=True),
    # A name no tool has: text.
    Sample("none", FMT, BEGIN + ds_call("rm", "{}") + END, answer=ds_call("rm", "{}"),
           names=frozenset({"get_weather"}), literal=True),
    # A name that is JSON markup is no name.
    Sample("none", FMT, ds_call('{"a"', "{}"), answer=ds_call('{"a"', "{}"), literal=True),
    # Cut by max_tokens inside the arguments: the call ends with what it had.
    Sample("none", FMT, BEGIN + ds_call("get_time", TIME).split("CET")[0],
           calls=(("get_time", '{"tz": "'),), reason=LENGTH),
    # Text before the section is answer; no arguments at all is `{}`.
    Sample("none", FMT, "Sure. " + BEGIN + f"{CALL}ping{SEP}{CALL_END}" + END,
           answer="Sure. ", calls=(("ping", "{}"),)),
]
IDS = [f"{s.channels}-{i}" for i, s in enumerate(SAMPLES)]


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_one_shot_and_every_split_point_agree(sample: Sample) -> None:
    one_shot_and_every_split_agree(sample)


def reference_calls(text: str) -> list[tuple[str, Any]]:
    """The calls vLLM's DeepSeek V3.1 parser finds: every begin ... sep ... end span."""
    pattern = (re.escape(CALL) + "(?P<name>.*?)" + re.escape(SEP) + "(?P<args>.*?)"
               + re.escape(CALL_END))
    return [(m["name"].strip(), json.loads(m["args"])) for m in
            re.finditer(pattern, text, flags=re.DOTALL)]


# Not the call without arguments: the reference has no JSON to read there (ours is `{}`).
@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.calls and s.reason is not LENGTH
                                    and s.calls != (("ping", "{}"),)],
                         ids=lambda s: s.channels)
def test_calls_match_the_reference_reading(sample: Sample) -> None:
    ours = [(name, json.loads(arguments)) for name, arguments in sample.calls]
    assert reference_calls(sample.text) == ours


def test_arguments_stream_as_they_are_written() -> None:
    text = BEGIN + ds_call("get_time", TIME) + END
    chunks = list(text)
    events = decode(Sample("none", FMT, text), chunks)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert isinstance(next(e for e in events if not isinstance(e, ToolCallDelta)),
                      ToolCallStart)
    # One delta per character, but for a `<` held until it cannot open a marker.
    assert len(deltas) == len(TIME) - 1 and "".join(d.arguments for d in deltas) == TIME


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # DeepSeek V3.1 by its section marker, in the template or the vocabulary.
        ("{{ '<\uff5ctool\u2581calls\u2581begin\uff5c>' }}", [], FMT),
        (None, {BEGIN, CALL, SEP, "<think>", "</think>"}, FMT),
        # ... and every other family as before.
        (None, {"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<think>"}, "kimi_k2"),
        ("<tool_call>\n<function=x>\n<parameter=y>", {"<tool_call>"}, "qwen3_coder"),
        (None, {"<tool_call>", "</tool_call>"}, "hermes"),
        ("{{ '<|python_tag|>' }}", [], "llama3_json"),
        (None, {"[TOOL_CALLS]", "[ARGS]"}, "mistral"),
        (None, {"<|channel|>", "<|message|>"}, "harmony"),
        ("<tool_call>{{ name }}<arg_key>", [], "glm47"),
        ("<|tool_call_start|>", {"<|tool_call_start|>", "<|tool_call_end|>"}, "pythonic"),
        ("<minimax:tool_call>", [], "minimax_m2"),
        ("{{ '<|tool_call>call:' + name }}{{ '<tool_call|>' }}", [], "gemma4"),
        ("<|im_start|>{{ m.content }}<|im_end|>", {"<think>"}, "none"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


def test_it_reasons_in_think_tags() -> None:
    vocab = {BEGIN, CALL, SEP, "<think>", "</think>"}
    assert detect_channel_format(None, vocab) == "think_tags"
    fmt = get_channel_format("think_tags")
    assert initial_state(fmt, "<\uff5cAssistant\uff5c><think>") == "reasoning"
    assert initial_state(fmt, "<\uff5cAssistant\uff5c></think>") == "answer_after"


def test_every_marker_is_reserved() -> None:
    fmt = TOOL_FORMATS[FMT]
    assert fmt.call_open == CALL and fmt.call_close == CALL_END
    assert set(fmt.reserved) == {BEGIN, END, CALL, CALL_END, SEP, *DEEPSEEK_V31_RESULTS}
    for marker in fmt.reserved:  # U+FF5C bars, U+2581 spaces
        assert marker.startswith("<\uff5c") and marker.endswith("\uff5c>") and " " not in marker


FRAGMENTS = [BEGIN, END, CALL, CALL_END, SEP, *DEEPSEEK_V31_RESULTS, "<think>", "</think>",
             "get_weather", "f", '{"a": [1, "}"]}', "{", "}", "[", '"', "\\", ": ", ", ",
             "\n", " ", "<\uff5c", "\uff5c>", "\u2581", "x", "こ", "STOP"]


test_random_markup_never_breaks_the_contract = random_markup_test(
    [("none", FMT), ("think_tags", FMT)], FRAGMENTS, 400)


# --- grammar (the canonical calls are also in test_guided_tools.py, every format) ------

MALFORMED = [
    BEGIN + ds_call("f", '{"a": "1"}') + END,  # breaks the schema
    BEGIN + f"{CALL}f{SEP}" + '{"a": 1}' + END,  # no call end
    BEGIN + ds_call("f", '{"a": 1}'),  # no section end
    ds_call("f", '{"a": 1}'),  # no section
    BEGIN + f"{CALL}functions.f{SEP}" + '{"a": 1}' + CALL_END + END,  # not the name
    BEGIN + f"{CALL}function{SEP}f\n```json\n" + '{"a": 1}' + "\n```" + CALL_END + END,  # V3's
]


@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(tok: str) -> None:
    refuses_malformed(FMT, tok, LOOSE, MALFORMED)




@pytest.mark.parametrize("tok", VARIANTS)
def test_what_the_grammar_writes_the_parser_reads(tok: str) -> None:
    g = grammar(FMT, ToolChoice("required"), tok, tools=(LOOSE,))
    for args in ROUND_TRIP:
        text = section(FMT, call_text(FMT, "f", args))
        assert accepts(g, text, tok), text
        sample = Sample("think_tags", FMT, text, state="answer_after",
                        calls=(("f", json.dumps(args)),))
        assert check(sample, decode(sample, [text])) == expected(sample)


@pytest.mark.parametrize("tok", VARIANTS)
def test_named_choice_forces_that_tool(tok: str) -> None:
    named_auto_choice_forces_that_tool(FMT, tok)


@pytest.mark.parametrize("tok", VARIANTS)
def test_auto_allows_text_then_parallel_calls_in_one_section(tok: str) -> None:
    g = grammar(FMT, ToolChoice("auto"), tok)
    weather = call_text(FMT, "get_weather", {"city": "Paris"})
    search = call_text(FMT, "search", {"query": "q", "limit": 2})
    assert accepts(g, "It is sunny.", tok)
    assert accepts(g, "Checking. " + section(FMT, weather, search), tok)
    assert not accepts(g, "Checking. " + section(FMT, weather) + " done", tok)
