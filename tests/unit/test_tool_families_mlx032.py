"""The tool formats mlx-lm 0.32 parses beyond the older ones: Gemma 4, FunctionGemma,
LongCat, MiniCPM5, Muse Spark and Kimi K3, and their reasoning markup.

As in `test_tool_families.py`: each sample runs through the whole output pipeline in one
shot, cut at every point and one character per chunk, all giving the same events; complete
calls are also read by mlx-lm's own parser for the format, which must find the same names
and arguments. The grammars accept their canonical calls in `test_guided_tools.py` (which
iterates over every format); here they refuse near misses, and what they write the parser
reads back as the arguments that were meant.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from replicas.contract import Channel, FinishReason, TextDelta, ToolChoice
from replicas.pipeline.channels import ChannelRouter, detect_format, get_format, initial_state
from replicas.pipeline.tool_formats import detect_tool_format
from replicas.pipeline.tool_gemma import gemma_value
from tests.unit.test_guided_tools import (LOOSE, ROUND_TRIP, VARIANTS, accepts, call_text, grammar,
                                          named_auto_choice_forces_that_tool, refuses_malformed,
                                          section)
from tests.unit.test_tool_calls import (Sample, check, decode, joined,
                                        one_shot_and_every_split_agree, random_markup_test, split)
from tests.unit.test_tool_families import matches_the_reference

LENGTH = FinishReason.LENGTH
WEATHER = '{"city": "Paris", "days": 3}'
SCHEMA = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}

Q = '<|"|>'
GEMMA4_CALL = (f"<|tool_call>call:get_weather{{city:{Q}Pa,ris}}{Q},days:3,"
               f"opts:{{a:[1,{Q}x, y{Q}],b:true,c:null}}}}<tool_call|>")
GEMMA4_ARGS = '{"city": "Pa,ris}", "days": 3, "opts": {"a": [1, "x, y"], "b": true, "c": null}}'
FG_CALL = ("<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3,"
           "unit:c}<end_function_call>")
LONGCAT_CALL = ("<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
                "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days"
                "</longcat_arg_key>\\n<longcat_arg_value>3</longcat_arg_value>\n"
                "</longcat_tool_call>")
MINICPM5_CALLS = ('<function name="get_weather"><param name="city"><![CDATA[ New\n<York> ]]>'
                  '</param><param name="days"> 3 </param></function>\n'
                  '<function name="ping"></function>')
MUSE_CALLS = ('<atem:function_calls>\n<atem:invoke name="get_weather">\n'
              '<atem:parameter name="city">Paris</atem:parameter>\n'
              '<atem:parameter name="days">3</atem:parameter>\n'
              '<atem:parameter name="note">"a STOP b"</atem:parameter>\n</atem:invoke>\n'
              '<atem:invoke name="ping">\n</atem:invoke>\n</atem:function_calls>')
K3_TYPED = ('<|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|> Tokyo &amp; co<|close|>argument'
            '<|sep|><|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
            '<|close|>call<|sep|>')
K3_JSON = ('<|open|>call tool="get_time" index="2"<|sep|><|open|>json type="object"<|sep|>'
           '{"tz": "CET", "n": [1, {"x": "}"}]}<|close|>json<|sep|><|close|>call<|sep|>')
K3_SECTION = "<|open|>tools<|sep|>{}<|close|>tools<|sep|>"

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
    # longcat: `<longcat_think>` reasoning, GLM's layout with its own tags
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
    # minicpm5: `<think>` reasoning, bare `<function>` blocks, CDATA values
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
    # muse_spark: values are JSON when they parse
    Sample("none", "muse_spark", "Checking. " + MUSE_CALLS, answer="Checking. ",
           calls=(("get_weather", '{"city": "Paris", "days": 3, "note": "a STOP b"}'),
                  ("ping", "{}")), stops=("STOP",)),
    Sample("none", "muse_spark", '<atem:function_calls><atem:invoke id="7" name="f">'
           '<atem:parameter type="x" name="q">[1, 2]</atem:parameter></atem:invoke>'
           "</atem:function_calls>", calls=(("f", '{"q": [1, 2]}'),)),
    Sample("none", "muse_spark", "<atem:function_calls>hello</atem:function_calls>",
           answer="<atem:function_calls>hello</atem:function_calls>", literal=True),
    # kimi_k3: XTML reasoning and answer wrapper, typed arguments or one JSON block
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
IDS = [f"{s.channels}+{s.tools}-{i}" for i, s in enumerate(SAMPLES)]


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_one_shot_and_every_split_point_agree(sample: Sample) -> None:
    one_shot_and_every_split_agree(sample)


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.calls and s.reason is not LENGTH],
                         ids=lambda s: f"{s.tools}")
def test_calls_match_mlx_lm_reference_parser(sample: Sample) -> None:
    matches_the_reference(sample, sample.tools)  # each parser is named as its format


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
        ("<longcat_tool_call>{{ name }}<longcat_arg_key>", [], "longcat"),
        ('<function name="{{ n }}"><param name="{{ p }}">', [], "minicpm5"),
        ("<atem:function_calls>\n<atem:invoke name=", [], "muse_spark"),
        (None, {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"}, "kimi_k3"),
        # ... and the older families still as before.
        ("<|tool_call_start|>", {"<|tool_call_start|>", "<|tool_call_end|>"}, "pythonic"),
        ("<tool_call>\n<function=x>\n<parameter=y>", {"<tool_call>"}, "qwen3_coder"),
        (None, {"<tool_call>", "</tool_call>"}, "hermes"),
        (None, {"<|channel|>", "<|message|>"}, "harmony"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


@pytest.mark.parametrize(("vocab", "want"), [
    ({"<longcat_think>", "</longcat_think>"}, "longcat_think"),
    ({"<|think:start|>", "<|think:end|>"}, "think_colon"),
    ({"<|channel>", "<channel|>", "<|tool_call>"}, "gemma4"),
    ({"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"}, "xtml"),
    # A single-token pair wins, as in mlx-lm's `_infer_thinking`.
    ({"<think>", "</think>", "<|channel>", "<channel|>"}, "think_tags"),
    ({"<|channel|>", "<|message|>"}, "harmony"),
])
def test_reasoning_formats_are_detected_as_mlx_lm_does(vocab: set[str], want: str) -> None:
    assert detect_format(None, vocab) == want


def route(fmt: str, text: str, chunks: Sequence[str], state: str | None = None
          ) -> list[tuple[Channel, str]]:
    router = ChannelRouter(get_format(fmt), state=state)
    pieces: list[TextDelta] = []
    for chunk in chunks:
        pieces += router.feed(chunk)
    return joined(pieces + router.finish())


R, A = Channel.REASONING, Channel.ANSWER


@pytest.mark.parametrize(("fmt", "text", "want"), [
    ("gemma4", "<|channel>thought\nPlan.\n<channel|>Answer", [(R, "Plan."), (A, "Answer")]),
    ("longcat_think", "<longcat_think>\nPlan.\n</longcat_think>\n\nAnswer",
     [(R, "Plan."), (A, "Answer")]),
    ("think_colon", "<|think:start|>Plan.<|think:end|>Answer", [(R, "Plan."), (A, "Answer")]),
    ("xtml", "<|open|>think<|sep|>Plan.<|close|>think<|sep|><|open|>response<|sep|>Answer"
             "<|close|>response<|sep|><|close|>message<|sep|>", [(R, "Plan."), (A, "Answer")]),
    ("gemma4", "<|channel>other<channel|>", [(A, "<|channel>other<channel|>")]),
])
def test_reasoning_markup_splits_at_every_boundary(
        fmt: str, text: str, want: list[tuple[Channel, str]]) -> None:
    assert route(fmt, text, [text]) == want
    for cut in range(1, len(text)):
        assert route(fmt, text, split(text, [cut])) == want, cut
    assert route(fmt, text, list(text)) == want


@pytest.mark.parametrize(("fmt", "prompt", "want"), [
    ("gemma4", "<|turn>model\n<|channel>thought\n", "reasoning"),
    ("gemma4", "<|turn>model\n<|channel>thought\n<channel|>", "answer_after"),
    ("xtml", "<|open|>assistant<|sep|><|open|>think<|sep|>", "reasoning"),
    ("longcat_think", "<longcat_think>\n", "reasoning"),
])
def test_prompt_opened_reasoning(fmt: str, prompt: str, want: str) -> None:
    assert initial_state(get_format(fmt), prompt) == want


FAMILIES = [("gemma4", "gemma4"), ("none", "function_gemma"), ("longcat_think", "longcat"),
            ("none", "minicpm5"), ("none", "muse_spark"), ("xtml", "kimi_k3")]
FRAGMENTS = [
    "<|tool_call>", "<tool_call|>", "call:f{", "call:", Q, "<|", "<start_function_call>",
    "<end_function_call>", "<escape>", "a:", ",", "}", "{", "[", "]", "<longcat_tool_call>",
    "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>",
    "</longcat_arg_value>", "\\n", '<function name="f">', "<function name=", "</function>",
    '<param name="p">', "</param>", "<![CDATA[", "]]>", "<atem:function_calls>",
    "</atem:function_calls>", '<atem:invoke name="f">', "</atem:invoke>",
    '<atem:parameter name="p">', "</atem:parameter>", "<|open|>tools<|sep|>",
    "<|close|>tools<|sep|>", '<|open|>call tool="f"<|sep|>', "<|close|>call<|sep|>",
    '<|open|>argument key="k" type="integer"<|sep|>', "<|close|>argument<|sep|>",
    '<|open|>json type="object"<|sep|>', "<|close|>json<|sep|>", "<|open|>think<|sep|>",
    "<|close|>think<|sep|>", "<|channel>thought", "<channel|>", "<longcat_think>",
    "</longcat_think>", '"', "\n", " ", "1", "x", "こ", "STOP",
]


test_random_markup_never_breaks_the_contract = random_markup_test(FAMILIES, FRAGMENTS, 400)


# --- grammars (the canonical calls of every format are in test_guided_tools.py) ---------

NEW = ("gemma4", "function_gemma", "longcat", "minicpm5", "muse_spark", "kimi_k3")
# Text the grammar must refuse: broken markup, and spellings the parser still reads but
# the grammar never writes.
MALFORMED = {
    "gemma4": ["<|tool_call>call:f{a:<|\"|>1<|\"|>}<tool_call|>",
               "<|tool_call>call:f{b:x}<tool_call|>", "<|tool_call>call:f{a:1<tool_call|>"],
    "function_gemma": ["<start_function_call>call:f{b:x}<end_function_call>",
                       "<start_function_call>call:f(a=1)<end_function_call>"],
    "longcat": ["<longcat_tool_call>f<longcat_arg_key>a</longcat_arg_key>1</longcat_tool_call>",
                "<longcat_tool_call>f<longcat_arg_value>1</longcat_arg_value>"
                "</longcat_tool_call>"],
    "minicpm5": ["<function name=f></function>", '<function name="f"><param name="a">x'
                 "</param></function>"],
    "muse_spark": ['<atem:function_calls>\n<atem:invoke name="f">\n<atem:parameter name="b">x'
                   "</atem:parameter>\n</atem:invoke>\n</atem:function_calls>"],
    "kimi_k3": ['<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                '<|open|>argument key="a" type="integer"<|sep|>1<|close|>argument<|sep|>'
                "<|close|>call<|sep|><|close|>tools<|sep|>"],
}


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("tok", VARIANTS)
def test_grammar_refuses_malformed_markup(fmt: str, tok: str) -> None:
    refuses_malformed(fmt, tok, LOOSE, MALFORMED[fmt])


CHANNELS = {"gemma4": "gemma4", "longcat": "longcat_think", "kimi_k3": "xtml"}


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("tok", VARIANTS)
def test_what_the_grammar_writes_the_parser_reads(fmt: str, tok: str) -> None:
    g = grammar(fmt, ToolChoice("required"), tok, tools=(LOOSE,))
    schemas = {"f": json.loads(LOOSE.parameters)}
    for args in ROUND_TRIP:
        if fmt == "minicpm5" and "\n" in args.get("b", ""):
            continue  # raw text is stripped by the reference: a newline inside stays
        text = section(fmt, call_text(fmt, "f", args))
        assert accepts(g, text, tok), text
        sample = Sample(CHANNELS.get(fmt, "none"), fmt, text, schemas=schemas,
                        calls=(("f", json.dumps(args) if args else "{}"),))
        got = check(sample, decode(sample, [text]))
        assert [json.loads(e[1]) for e in got if e[0] == "end"] == [args], text


@pytest.mark.parametrize("tok", VARIANTS)
def test_kimi_k3_auto_lets_the_answer_wrapper_through(tok: str) -> None:
    g = grammar("kimi_k3", ToolChoice("auto"), tok)
    call = section("kimi_k3", call_text("kimi_k3", "get_weather", {"city": "Paris"}))
    wrapped = "<|open|>response<|sep|>Checking.<|close|>response<|sep|>"
    assert accepts(g, wrapped, tok)
    assert accepts(g, wrapped + call, tok)
    assert not accepts(g, wrapped + call.replace("get_weather", "nope"), tok)


@pytest.mark.parametrize("fmt", NEW)
def test_named_choice_forces_that_tool(fmt: str) -> None:
    named_auto_choice_forces_that_tool(fmt)
