"""Tools with the request's own answer grammar (`response_format`): in `auto` the grammar is
a call in the format's own syntax or an answer under the answer grammar, never free text;
a forced call drops the answer, `none` leaves the answer grammar alone.

Every format, on the two tokenizers of test_guided_tools (markers as special tokens, and
as plain text). Nothing is downloaded and no model is built.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    GuidedSpec,
    TextDelta,
    ToolCallStart,
    ToolChoice,
    ToolSpec,
)
from replicas.errors import InvalidRequestError
from replicas.families.registry import TOOL_FORMATS, get_channel_format
from replicas.pipeline.compose import with_tools
from replicas.pipeline.decoding import RequestDecoder
from replicas.pipeline.guided import compile_guided
from replicas.pipeline.guided.tools import compile_tool_grammar
from replicas.pipeline.tool_plan import ToolPlan, plan_tools
from tests.unit.test_guided_tools import (
    CASES,
    PARIS,
    TOOLS,
    accepts,
    builtin_guided_tokenizer,
    call_text,
    grammar,
    section,
    tool,
    variant,
)

ANSWER_SCHEMA = {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 20},
                                "sunny": {"type": "boolean"}},
                 "required": ["city", "sunny"], "additionalProperties": False}
SCHEMA = GuidedSpec("json_schema", json.dumps(ANSWER_SCHEMA), strict=True)
ANSWER = '{"city": "Paris", "sunny": true}'


def union(fmt: str, tok: str = "tokens", answer: GuidedSpec = SCHEMA,
          choice: ToolChoice = ToolChoice("auto")) -> str:
    compiled = compile_tool_grammar(fmt, TOOLS, choice, tokenizer=variant(tok)[1], answer=answer)
    assert compiled is not None
    return compiled.grammar


def answered(fmt: str, text: str) -> str:
    """An answer where the format puts text: after harmony's final-channel header."""
    return f"<|channel|>final<|message|>{text}" if fmt == "harmony" else text


@pytest.mark.parametrize(("fmt", "tok"), CASES)
def test_auto_is_a_call_or_an_answer_under_the_schema(fmt: str, tok: str) -> None:
    g = union(fmt, tok)
    call = section(fmt, call_text(fmt, "get_weather", PARIS))
    assert accepts(g, call, tok)
    assert accepts(g, answered(fmt, ANSWER), tok)
    assert accepts(g, answered(fmt, '{"city":"Rome","sunny":false}'), tok)
    # Never free text: not instead of the answer, not before a call.
    assert not accepts(g, answered(fmt, "It is sunny."), tok)
    if fmt != "harmony":  # harmony's text needs its header anyway
        assert not accepts(g, "Let me check.\n" + call, tok)
    # The answer holds to the schema, and no call follows it.
    assert not accepts(g, answered(fmt, '{"city": "Paris"}'), tok)
    assert not accepts(g, answered(fmt, '{"city": 1, "sunny": true}'), tok)
    assert not accepts(g, answered(fmt, '{"city": "Paris", "sunny": true, "x": 1}'), tok)
    # The calls still hold to their tools.
    assert not accepts(g, section(fmt, call_text(fmt, "search", {"query": "q", "limit": 0})), tok)
    assert not accepts(g, section(fmt, call_text(fmt, "get_wether", PARIS)), tok)


def test_kimi_k3_answer_may_sit_in_its_response_wrapper() -> None:
    g = union("kimi_k3")
    assert accepts(g, f"<|open|>response<|sep|>{ANSWER}<|close|>response<|sep|>")


def test_harmony_answer_may_follow_an_analysis_message() -> None:
    analysis = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    g = union("harmony")
    assert accepts(g, analysis + answered("harmony", ANSWER))
    assert accepts(g, analysis + call_text("harmony", "get_weather", PARIS))


@pytest.mark.parametrize(("answer", "good", "bad"), [
    (GuidedSpec("json_object"), '{"any": [1, {"x": null}]}', "[1, 2]"),
    (GuidedSpec("regex", "[0-9]{1,3}"), "42", "4200"),
    (GuidedSpec("choice", ("yes", "no")), "no", "maybe"),
    (GuidedSpec("grammar", 'start: "a" b\nb: "c"+'), "acc", "ab"),
])
def test_every_answer_kind_composes_with_the_calls(answer: GuidedSpec, good: str,
                                                   bad: str) -> None:
    g = union("hermes", answer=answer)
    assert accepts(g, good) and not accepts(g, bad)
    assert accepts(g, section("hermes", call_text("hermes", "search", {"query": "q",
                                                                       "limit": 1})))


def test_a_bad_answer_schema_fails_as_response_format_does_alone() -> None:
    bad = GuidedSpec("json_schema", json.dumps({"type": "object", "minProperties": "x"}))
    with pytest.raises(InvalidRequestError) as with_tools_info:
        union("hermes", answer=bad)
    with pytest.raises(InvalidRequestError) as alone:
        compile_guided(bad)
    assert with_tools_info.value.message == alone.value.message
    assert with_tools_info.value.param == alone.value.param


def test_a_tool_keyword_the_grammar_leaves_out_is_still_a_warning() -> None:
    unique = tool("u", {"type": "object", "properties": {
        "t": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    compiled = compile_tool_grammar("hermes", (unique,), ToolChoice("auto"),
                                    tokenizer=builtin_guided_tokenizer(), answer=SCHEMA)
    assert compiled is not None and any("uniqueItems" in w for w in compiled.warnings)


def test_a_forced_call_has_no_answer_to_constrain() -> None:
    with pytest.raises(ValueError, match="tool_choice auto"):
        union("hermes", choice=ToolChoice("required"))


# --- the plan: which grammar a request gets ---------------------------------------------

def request(choice: ToolChoice, guided: GuidedSpec | None = SCHEMA,
            tools: tuple[ToolSpec, ...] = TOOLS) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m",
                             prompt=ChatPrompt((ChatMessage("user", "Weather?"),)),
                             guided=guided, tools=tools, tool_choice=choice)


def plan(fmt: str, choice: ToolChoice, guided: GuidedSpec | None = SCHEMA) -> ToolPlan:
    hf, tok = variant("tokens")
    return plan_tools(request(choice, guided), TOOL_FORMATS[fmt], lambda: tok,
                      lambda text: hf.encode(text, add_special_tokens=False))


def test_auto_plans_the_union_and_owns_the_answer() -> None:
    planned = plan("hermes", ToolChoice("auto"))
    assert planned.owns_answer and planned.parsing is not None
    assert planned.grammar == union("hermes")


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("required", "search"),
                                    ToolChoice("auto", "search")])
def test_a_forced_call_drops_the_answer(choice: ToolChoice) -> None:
    planned = plan("hermes", choice)
    assert not planned.owns_answer
    assert planned.grammar == grammar("hermes", choice)


def test_a_bad_answer_schema_is_refused_even_when_a_forced_call_drops_it() -> None:
    bad = GuidedSpec("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        plan("hermes", ToolChoice("required"), bad)


def test_none_leaves_the_answer_grammar_alone() -> None:
    # No tool grammar: the request's own grammar is the only one (prepare.py compiles it),
    # and the format's markers are banned as for any `none`.
    planned = plan("hermes", ToolChoice("none"))
    assert planned.grammar is None and planned.parsing is None and planned.banned_ids


def test_llama_json_answer_starting_with_name_is_the_answer_not_a_call() -> None:
    # Llama 3 may open a call with a bare `{"name"`; beside an answer grammar every call
    # opens with `<|python_tag|>`, so an answer whose first key is "name" stays the answer.
    planned = plan("llama3_json", ToolChoice("auto"))
    assert planned.parsing is not None and planned.parsing.format.bare_open is None
    assert plan("llama3_json", ToolChoice("required")).parsing.format.bare_open  # type: ignore[union-attr]
    text = '{"name": "get_weather", "city": "Paris"}'
    chunks = list(text)
    fmt = with_tools(get_channel_format("none"), planned.parsing.format)
    decoder = RequestDecoder(lambda ids: "".join(chunks[i] for i in ids), fmt, Channel.ANSWER,
                             None, (), False, 5, tools=planned.parsing)
    events: list[Any] = []
    for token in range(len(chunks)):
        events += decoder.feed(token)
    assert not [e for e in events if isinstance(e, ToolCallStart)]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
