"""`tool_choice: none`: no marker of the model's tool format reaches the answer.

A model that wants to call may write the call anyway once its opening token is banned
(`{"name": ...}\n</tool_call>`). Every format's `reserved` markers (open, close, the
tool-result wrappers) are banned where each is one token, and the router drops them all
from the answer, however the text is split and whatever the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    TextDelta,
    ToolChoice,
    ToolSpec,
)
from replicas.families.registry import TOOL_FORMATS, get_channel_format, get_tool_format
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat
from replicas.pipeline.channels import ChannelRouter
from replicas.pipeline.compose import without_calls
from replicas.pipeline.tool_plan import plan_tools, reserved_token_ids

WITH_CALLS = [name for name, fmt in TOOL_FORMATS.items() if fmt.grammar is not None]

# Every marker of each family's call and tool-result markup.
RESERVED = {
    "hermes": {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"},
    "qwen3_coder": {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"},
    "llama3_json": {"<|python_tag|>"},
    "mistral": {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"},
    "harmony": {"<|call|>"},
    "kimi_k2": {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"},
    "glm47": {"<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>"},
    "minimax_m2": {"<minimax:tool_call>", "</minimax:tool_call>"},
    "pythonic": {"<|tool_call_start|>", "<|tool_call_end|>"},
    "kimi_k3": {"<|open|>tools<|sep|>", "<|close|>tools<|sep|>", "<|open|>call",
                "<|close|>call<|sep|>", "<|open|>argument", "<|close|>argument<|sep|>",
                "<|open|>json", "<|close|>json<|sep|>"},
    "gemma4": {"<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"},
    "function_gemma": {"<start_function_call>", "<end_function_call>",
                       "<start_function_response>", "<end_function_response>"},
    "longcat": {"<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
                "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>"},
    "minicpm5": {"<function name=", "</function>"},
    "muse_spark": {"<atem:function_calls>", "</atem:function_calls>"},
    "deepseek_v31": {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<｜tool▁outputs▁begin｜>",
                     "<｜tool▁outputs▁end｜>"},
}
# The reasoning format of each family whose reasoning is not `<think>` tags.
OWN_REASONING = {"harmony": "harmony", "kimi_k3": "xtml", "gemma4": "gemma4",
                 "longcat": "longcat_think"}
ALL_MARKERS = sorted({m for markers in RESERVED.values() for m in markers})
# A vocabulary where every marker is one token (as in the families' own vocabularies);
# any other text is one token per character.
TOKEN_OF = {marker: 100_000 + i for i, marker in enumerate(ALL_MARKERS)}


def encode_markers_as_tokens(text: str) -> tuple[int, ...]:
    return (TOKEN_OF[text],) if text in TOKEN_OF else tuple(ord(c) for c in text)


def encode_as_text(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


def bases(tools: str) -> list[str]:
    """The channel formats a model of this tool format can have."""
    if tools in ("harmony", "kimi_k3"):  # tied to their channel format
        return [OWN_REASONING[tools]]
    return ["none", OWN_REASONING.get(tools, "think_tags")]


def leak(tools: str) -> str:
    """What a model that calls under `none` may write: a call with its markers, a made-up
    tool result, text around them."""
    markers = sorted(RESERVED[tools])
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    return "Sure.\n" + "".join(f"{m}{body}" for m in markers) + "It is sunny."


def route(fmt_name: str, tools: str, text: str, chunks: Sequence[str] | None = None,
          state: str | None = None) -> tuple[str, str]:
    fmt = without_calls(get_channel_format(fmt_name), get_tool_format(tools))
    router = ChannelRouter(fmt, state=state)
    pieces: list[TextDelta] = []
    for chunk in chunks if chunks is not None else [text]:
        pieces += router.feed(chunk)
    pieces += router.finish()
    answer = "".join(p.text for p in pieces if p.channel is Channel.ANSWER)
    reasoning = "".join(p.text for p in pieces if p.channel is Channel.REASONING)
    return answer, reasoning


def test_every_format_reserves_its_call_and_result_markers() -> None:
    assert {name: set(TOOL_FORMATS[name].reserved) for name in WITH_CALLS} == RESERVED
    assert TOOL_FORMATS["none"].reserved == ()


def test_a_format_must_reserve_its_own_delimiters() -> None:
    grammar = CallGrammar(trigger="<a>", head="<a>{name}", tail="</a>")
    with pytest.raises(ValueError, match="reserved"):
        ToolFormat(name="x", syntax=Syntax.JSON, call_open="<a>", call_close="</a>",
                   grammar=grammar, reserved=("<a>",))
    with pytest.raises(ValueError, match="reserved"):
        ToolFormat(name="y", syntax=Syntax.RAW, grammar=grammar)


@pytest.mark.parametrize("tools", WITH_CALLS)
def test_none_bans_every_marker_that_is_one_token(tools: str) -> None:
    fmt = TOOL_FORMATS[tools]
    banned = reserved_token_ids(fmt, encode_markers_as_tokens)
    assert sorted(banned) == sorted(TOKEN_OF[m] for m in RESERVED[tools])
    # A marker of several tokens is not banned: each of its tokens also writes plain text.
    assert reserved_token_ids(fmt, encode_as_text) == ()


@pytest.mark.parametrize("tools", WITH_CALLS)
def test_plan_for_none_bans_and_suppresses_the_models_format(tools: str) -> None:
    def no_grammar() -> object:
        raise AssertionError("`none` compiles no grammar")

    request = GenerationRequest(
        request_id="r", model="m", prompt=ChatPrompt((ChatMessage("user", "Weather?"),)),
        tools=(ToolSpec("get_weather"),), tool_choice=ToolChoice("none"))
    plan = plan_tools(request, TOOL_FORMATS[tools], no_grammar,  # type: ignore[arg-type]
                      encode_markers_as_tokens)
    assert plan.parsing is None and plan.grammar is None
    assert set(plan.banned_ids) == {TOKEN_OF[m] for m in RESERVED[tools]}
    assert plan.suppressed is TOOL_FORMATS[tools]


@pytest.mark.parametrize("tools", WITH_CALLS)
def test_no_marker_reaches_the_answer_however_split(tools: str) -> None:
    text = leak(tools)
    for base in bases(tools):
        whole, _ = route(base, tools, text)
        assert not any(m in whole for m in RESERVED[tools]), (base, whole)
        if base != "harmony":  # harmony's own rules also route `<|call|>`
            want = text
            for marker in RESERVED[tools]:
                want = want.replace(marker, "")
            assert whole == want
        for cut in range(1, len(text)):
            assert route(base, tools, text, [text[:cut], text[cut:]]) == (whole, ""), cut
        assert route(base, tools, text, list(text)) == (whole, "")


@settings(max_examples=200, deadline=None)
@given(tools=st.sampled_from(WITH_CALLS), data=st.data())
def test_random_markup_and_splits_never_leak(tools: str, data: st.DataObject) -> None:
    parts = data.draw(st.lists(st.sampled_from(
        [*RESERVED[tools], "\n", "a b", "{\"name\"", "<think>", "</think>", "<|channel|>final",
         "<|message|>", "<|end|>", "<", "[", "|>"]), max_size=12))
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    for base in bases(tools):
        answer, _ = route(base, tools, text, chunks)
        assert not any(m in answer for m in RESERVED[tools]), (base, chunks, answer)


def test_reasoning_keeps_its_text_and_other_formats_are_untouched() -> None:
    think = get_channel_format("think_tags")
    text = leak("hermes")
    answer, reasoning = route("think_tags", "hermes", text + "</think>" + text, state="reasoning")
    assert reasoning.strip("\n") == text.strip("\n") and "</tool_call>" not in answer
    # Harmony's channel format already keeps `<|call|>` out of every answer state.
    harmony = get_channel_format("harmony")
    assert without_calls(harmony, get_tool_format("harmony")) is harmony
    suppressed = without_calls(think, get_tool_format("hermes"))
    assert without_calls(think, get_tool_format("hermes")) is suppressed  # cached
    assert suppressed.states["reasoning"] == think.states["reasoning"]
