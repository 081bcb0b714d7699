"""The tool formats of today's coding models (Kimi K2, GLM-4.5/4.7, MiniMax-M2).

Each sample runs through the whole output pipeline as `test_tool_calls.py` runs its own:
one shot, cut at every point, and one character per chunk must all give the same events.
Complete calls are also read by mlx-lm's own parser for the format (the reference), which
must find the same names and arguments. Each grammar accepts its format's canonical calls
in `test_guided_tools.py` (which iterates over every format) and refuses near misses here;
`tool_choice: none` is `test_tool_choice_none.py`'s (also over every format).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Sequence
from typing import Any

import pytest

from replicas.contract import FinishReason, ToolChoice
from replicas.pipeline.channels import detect_format
from replicas.pipeline.tool_formats import TOOL_FORMATS, detect_tool_format
from tests.unit.test_guided_tools import (VARIANTS, accepts, call_text, grammar, refuses_malformed,
                                          section, tool)
from tests.unit.test_tool_calls import (Sample, check, decode, expected,
                                        one_shot_and_every_split_agree, random_markup_test)

LENGTH = FinishReason.LENGTH
# The reference parser of each format: mlx_lm.tool_parsers.<module>.
REFERENCE = {"kimi_k2": "kimi_k2", "glm47": "glm47", "minimax_m2": "minimax_m2",
             "pythonic": "pythonic"}

KIMI_WEATHER = ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|>')
KIMI_TIME = ('<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
             '{"tz": "CET", "n": [1, {"x": "}"}]}<|tool_call_end|>')
KIMI_SECTION = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
GLM47_CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
GLM45_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
MINIMAX_CALLS = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
                 'Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
                 '<invoke name="ping">\n</invoke>\n</minimax:tool_call>')
PYTHONIC_CALLS = ('<|tool_call_start|>[get_weather(city="Pa,ris)", days=3, opts={"a": [1, (2)], '
                  '"b": true, "c": None}), ping()]<|tool_call_end|>')
WEATHER = '{"city": "Paris", "days": 3}'
WEATHER_SCHEMA = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}

SAMPLES: list[Sample] = [
    # kimi_k2: K2 Thinking reasons in `<think>` tags
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
    # glm47: GLM-4.7's compact form and GLM-4.5's lines
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
    # minimax_m2: MiniMax-M2 reasons in `<think>` tags too
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
    # pythonic (LFM2): Python literals, or JSON's, per keyword argument
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
IDS = [f"{s.channels}+{s.tools}-{i}" for i, s in enumerate(SAMPLES)]


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_one_shot_and_every_split_point_agree(sample: Sample) -> None:
    one_shot_and_every_split_agree(sample)


def reference_calls(parser: str, text: str, schemas: dict[str, Any]
                    ) -> list[tuple[str, Any]]:
    """The calls mlx-lm's `parser` finds in `text`: each tool_call_start ... end span, parsed."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    tools = [{"function": {"name": n, "parameters": s}} for n, s in schemas.items()] or None
    spans = re.findall(re.escape(module.tool_call_start) + "(.*?)"
                       + re.escape(module.tool_call_end), text, flags=re.DOTALL)
    calls: list[tuple[str, Any]] = []
    for span in spans:
        parsed = module.parse_tool_call(span, tools)
        calls += [(c["name"], c["arguments"]) for c in
                  (parsed if isinstance(parsed, list) else [parsed])]
    return calls


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.calls and s.reason is not LENGTH],
                         ids=lambda s: f"{s.tools}")
def test_calls_match_mlx_lm_reference_parser(sample: Sample) -> None:
    matches_the_reference(sample, REFERENCE[sample.tools])


def matches_the_reference(sample: Sample, parser: str) -> None:
    """mlx-lm's `parser` finds the sample's calls in its text."""
    ours = [(name, json.loads(arguments)) for name, arguments in sample.calls]
    assert reference_calls(parser, sample.text, sample.schemas) == ours


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The texts mlx-lm's `_infer_tool_parser` detects each family by.
        ("{{ '<|tool_calls_section_begin|>' }}{% for tc in m.tool_calls %}"
         "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>", [], "kimi_k2"),
        (None, {"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<think>"}, "kimi_k2"),
        ("<tool_call>{{ tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key>"
         "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>", [], "glm47"),
        (None, {"<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"}, "glm47"),
        ("<minimax:tool_call>\n<invoke name=\"{{ tc.name }}\">\n<parameter name=", [],
         "minimax_m2"),
        ("{{- '<|tool_call_start|>' }}[{{ tc.name }}(", [], "pythonic"),
        (None, {"<|tool_call_start|>", "<|tool_call_end|>"}, "pythonic"),
        # The families that share `<tool_call>` are still told apart.
        ("<tool_call>\n<function=x>\n<parameter=y>", {"<tool_call>"}, "qwen3_coder"),
        (None, {"<tool_call>", "</tool_call>"}, "hermes"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


@pytest.mark.parametrize("vocab", [
    {"<think>", "</think>", "<|tool_calls_section_begin|>"},  # Kimi K2 Thinking
    {"<think>", "</think>", "<tool_call>", "<arg_key>"},  # GLM-4.5 to 4.7
    {"<think>", "</think>", "<minimax:tool_call>"},  # MiniMax-M2
])
def test_these_families_reason_in_think_tags(vocab: set[str]) -> None:
    assert detect_format(None, vocab) == "think_tags"


def test_section_markers_are_reserved_and_dropped_around_calls() -> None:
    kimi = TOOL_FORMATS["kimi_k2"]
    assert set(kimi.section) <= set(kimi.reserved)
    sample = Sample("none", "kimi_k2", "A" + KIMI_SECTION.format("") + "B", answer="AB")
    assert check(sample, decode(sample, [sample.text])) == expected(sample)


FAMILIES = [("think_tags", "kimi_k2"), ("none", "glm47"), ("think_tags", "minimax_m2"),
            ("none", "pythonic")]
FRAGMENTS = [
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "functions.f:0", "<tool_call>",
    "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">', "</invoke>",
    '<parameter name="p">', "</parameter>", "<think>", "</think>", '{"a": [1, "}"]}', "{",
    "<|tool_call_start|>", "[", "]", "f(", "a=1", "b='x'", ", ", ")", "(",
    "}", '"', "\n", " ", "f", "x", "こ", "STOP",
]


test_random_markup_never_breaks_the_contract = random_markup_test(FAMILIES, FRAGMENTS, 300)


# --- grammars (the canonical calls of every format are in test_guided_tools.py) ---------

LOOSE = tool("f", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}})
OPEN = tool("g", {"type": "object"})
# Text the grammar must refuse: broken markup, and spellings the parser would still read
# but the grammar never writes (an unquoted MiniMax name, Python's `'x'` and `True`).
MALFORMED = {
    "kimi_k2": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.f"
                '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>',
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                '<|tool_call_argument_begin|>{"a": 1}<|tool_calls_section_end|>'],
    "glm47": ["<tool_call>f<arg_key>a</arg_key>1</tool_call>",
              "<tool_call>f<arg_value>1</arg_value></tool_call>"],
    "minimax_m2": ["<minimax:tool_call>\n<invoke name=f>\n</invoke>\n</minimax:tool_call>",
                   '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">x</parameter>'
                   "\n</invoke>\n</minimax:tool_call>"],
    "pythonic": ["<|tool_call_start|>[f(1)]<|tool_call_end|>",
                 "<|tool_call_start|>[f(, a=1)]<|tool_call_end|>",
                 "<|tool_call_start|>[f(b='x')]<|tool_call_end|>",
                 "<|tool_call_start|>[f(c=True)]<|tool_call_end|>",
                 "<|tool_call_start|>[f(b=\"x\", a=1)]<|tool_call_end|>"],
}


@pytest.mark.parametrize("fmt", sorted(MALFORMED))
@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(fmt: str, tok: str) -> None:
    refuses_malformed(fmt, tok, LOOSE, MALFORMED[fmt])


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


@pytest.mark.parametrize("fmt", ["glm47", "minimax_m2"])
def test_raw_string_values_end_at_their_close_tag(fmt: str) -> None:
    g = grammar(fmt, ToolChoice("required"), tools=(LOOSE,))
    assert accepts(g, section(fmt, call_text(fmt, "f", {"b": "New\nYork <b>&</b>"})))
    assert not accepts(g, section(fmt, call_text(fmt, "f", {"a": "one"})))
