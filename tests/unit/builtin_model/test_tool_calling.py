"""The built-in models' tool calling: scripts, chat template, marker tokens, and the
production prompt rendering (replicas.pipeline.prompt) of tools and calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from replicas.builtin import load_scripts, script
from replicas.builtin.scripts import Script, parse_scripts
from replicas.builtin.tokenizer_files import PLAIN_ADDED_TOKENS, prompt_ids
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    ReasoningSpec,
    TextPrompt,
    ToolCall,
    ToolSpec,
)
from replicas.errors import InvalidRequestError
from replicas.pipeline.prompt import render_chat_text, render_prompt
from tests.unit.builtin_model.test_scripts import one_script_json


WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{TOOL_LINES}\n</tools>\n\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
WEATHER_LINE = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the '
    'weather.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
)


def _call(cid: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_prompt(s: Script) -> ChatPrompt:
    """A script's messages as the ingress adapters hand them to the replica."""
    return ChatPrompt(tuple(
        ChatMessage(m.role, m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                    name=m.name)
        for m in s.messages
    ))


def test_tool_scripts() -> None:
    tools = {s.id: s for s in load_scripts() if s.tools}
    assert set(tools) == {"tool-one", "tool-parallel", "tool-result", "tool-after-reasoning",
                          "tool-text-then-call", "tool-parse"}
    parse = tools.pop("tool-parse")  # the SDK's pydantic tool: titles, one tool
    assert parse.expected_calls == (("get_weather", '{"city": "Berlin"}'),)
    assert json.loads(parse.tools[0].parameters)["title"] == "GetWeather"
    for s in tools.values():
        assert [t.name for t in s.tools] == ["get_weather", "get_time"]
        assert all(json.loads(t.parameters)["additionalProperties"] is False for t in s.tools)
    one = script("tool-one")
    assert one.answer == WEATHER_CALL and one.answer_text == ""
    assert one.expected_calls == (("get_weather", '{"city": "Paris"}'),)
    assert script("tool-parallel").answer == WEATHER_CALL + "\n" + WEATHER_CALL.replace(
        "Paris", "Tokyo")
    assert len(script("tool-parallel").expected_calls) == 2
    text_first = script("tool-text-then-call")
    assert text_first.answer_text == "Let me check."
    assert text_first.expected_calls == (("get_weather", '{"city": "Rome"}'),)
    after = script("tool-after-reasoning")
    assert after.enable_thinking is True and after.reasoning
    assert after.expected_text.startswith("<think>\n") and after.expected_text.endswith(
        '\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
        '"Asia/Tokyo"}}\n</tool_call>')
    # tool-result continues tool-one: its history holds tool-one's call and a result.
    result = script("tool-result")
    assert result.messages[0] == one.messages[0]
    paris_call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    assert result.messages[1].tool_calls == (paris_call,)
    assert result.messages[2].role == "tool" and result.messages[2].tool_call_id == "call_1"
    assert result.expected_calls == () and result.answer == "It is sunny in Paris, 18 degrees."
    # The same question without tools gets text: the tool block is what makes the call.
    none = script("tool-none-offered")
    assert none.messages == one.messages and none.tools == ()
    assert none.answer == "I cannot check the weather."


def test_script_wire_and_template_shapes() -> None:
    result = script("tool-result")
    assistant, tool = result.message_dicts[1:]
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert tool == {"role": "tool", "content": '{"temperature": 18, "condition": "sunny"}',
                    "tool_call_id": "call_1", "name": "get_weather"}
    assert result.template_messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"}
    assert result.tool_dicts[0]["function"]["parameters"]["required"] == ["city"]
    assert script("hello").message_dicts == [{"role": "user", "content": "Hello!"}]


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"answer": WEATHER_CALL}, "does not offer"),
        ({"tools": _TOOLS, "answer": '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'},
         "template form"),
        ({"tools": _TOOLS, "answer": '<tool_call>\n{"name": "f", "arguments": {}}\n'
                                     "</tool_call> and more"}, "end the answer"),
        ({"tools": _TOOLS, "answer": '<tool_call>\n{"name": "f", "arguments": {}\n</tool_call>'},
         "not valid JSON"),
        ({"tools": _TOOLS, "answer": 'Sure.<tool_call>\n{"name": "f", "arguments": {}}\n'
                                     "</tool_call>"}, "ends with a newline"),
        ({"tools": [{"type": "web", "function": {}}]}, "malformed"),
        ({"tools": _TOOLS, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "tool", "content": "1", "tool_call_id": "nope", "name": "f"}]},
         "answers an earlier call"),
        ({"tools": _TOOLS, "messages": [
            {"role": "user", "content": "Hi", "tool_calls": [_call("a", "f", {})]}]},
         "only assistant"),
        ({"tools": _TOOLS, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "g", {})]},
            {"role": "user", "content": "Hi"}]}, "unknown tool"),
        ({"kind": "completion", "prompt": "x", "messages": [], "tools": _TOOLS}, "no tools"),
    ],
)
def test_invalid_tool_scripts_are_rejected(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_scripts(one_script_json(**fields))


def test_a_script_may_end_with_a_tool_result() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [_call("a", "f", {"x": 1})]},
        {"role": "tool", "content": "1", "tool_call_id": "a", "name": "f"},
    ]
    (parsed,) = parse_scripts(one_script_json(tools=_TOOLS, messages=messages))
    assert parsed.messages[-1].role == "tool"
    assert parsed.messages[1].tool_calls == (ToolCall("a", "f", '{"x": 1}'),)


def test_tool_markers_are_plain_added_tokens(hf: Any) -> None:
    markers = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    assert set(markers) <= set(PLAIN_ADDED_TOKENS)
    added = {t.content: t for t in hf.added_tokens_decoder.values()}
    for marker in markers:
        assert len(hf.encode(marker, add_special_tokens=False)) == 1, marker
        assert added[marker].special is False
    ids = hf.encode(WEATHER_CALL + "<|im_end|>", add_special_tokens=False)
    assert hf.convert_ids_to_tokens(ids)[0] == "<tool_call>"
    assert hf.decode(ids, skip_special_tokens=True) == WEATHER_CALL


def _render(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                      **kwargs))


def test_template_puts_tools_in_the_system_turn_like_qwen3(hf: Any) -> None:
    block = TOOLS_BLOCK.replace("{TOOL_LINES}", WEATHER_LINE)
    user = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _render(hf, [{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL]) == (
        f"<|im_start|>system\n{block}<|im_end|>\n{user}")
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _render(hf, with_system, tools=[WEATHER_TOOL]) == (
        f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n{user}")
    # One tojson line per tool; without tools there is no tool block at all.
    two = _render(hf, with_system, tools=[WEATHER_TOOL, WEATHER_TOOL])
    assert f"<tools>\n{WEATHER_LINE}\n{WEATHER_LINE}\n</tools>" in two
    assert _render(hf, with_system) == f"<|im_start|>system\nBe brief.<|im_end|>\n{user}"
    assert _render(hf, with_system, tools=[]) == _render(hf, with_system)


def test_template_renders_calls_and_grouped_results_like_qwen3(hf: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            _call("a", "get_weather", {"city": "Paris"}), _call("b", "get_time", {})]},
        {"role": "tool", "content": "r1", "tool_call_id": "a", "name": "get_weather"},
        {"role": "tool", "content": "r2", "tool_call_id": "b", "name": "get_time"},
        {"role": "assistant", "content": "", "tool_calls": [
            _call("c", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "r3", "tool_call_id": "c", "name": "get_weather"},
    ]
    assert _render(hf, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n" + WEATHER_CALL + "\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n" + WEATHER_CALL.replace("Paris", "Rome") + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_scripted_calls_match_how_the_template_renders_them(hf: Any) -> None:
    # The model's output, sent back as history, renders to the very same text.
    one, result = script("tool-one"), script("tool-result")
    history = _render(hf, result.template_messages, tools=result.tool_dicts)
    assert f"<|im_start|>assistant\n{one.answer}<|im_end|>\n" in history
    prompt_one = _render(hf, one.template_messages, tools=one.tool_dicts)
    assert history.startswith(prompt_one)
    text_first = script("tool-text-then-call")
    replayed = [*text_first.template_messages, {
        "role": "assistant", "content": text_first.answer_text,
        "tool_calls": [_call("x", n, json.loads(a)) for n, a in text_first.expected_calls]}]
    assert f"<|im_start|>assistant\n{text_first.answer}<|im_end|>" in _render(hf, replayed)


def test_render_prompt_matches_the_scripts_for_every_script(hf: Any) -> None:
    # Production rendering (contract types -> template dicts) trains on what it serves.
    for s in load_scripts():
        if s.kind != "chat":
            continue
        rendered = render_prompt(hf, _chat_prompt(s), ReasoningSpec(enabled=s.enable_thinking),
                                 len(hf), tools=s.tools)
        assert list(rendered.token_ids) == prompt_ids(hf, s), s.id
    bare = render_chat_text(hf, _chat_prompt(script("tool-one")), ReasoningSpec())
    assert "# Tools" not in bare


def test_render_prompt_passes_tools_only_when_there_are_some() -> None:
    seen: list[dict[str, Any]] = []

    class Recorder:
        chat_template = "x"

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            seen.append({"messages": messages, **kwargs})
            return "text"

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return [1]

    prompt = _chat_prompt(script("tool-result"))
    render_prompt(Recorder(), prompt, ReasoningSpec(), 10)
    assert "tools" not in seen[-1]
    tool = ToolSpec("get_weather", "Weather.", '{"type": "object"}')
    render_prompt(Recorder(), prompt, ReasoningSpec(), 10, tools=(tool,))
    assert seen[-1]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}}]
    assert seen[-1]["messages"][1:] == script("tool-result").template_messages[1:]
    render_prompt(Recorder(), prompt, ReasoningSpec(), 10, tools=(ToolSpec("f"),))
    assert seen[-1]["tools"][0]["function"] == {"name": "f", "parameters": {"type": "object"}}
    # Completions never go through the template, tools or not.
    render_prompt(Recorder(), TextPrompt("Hi"), ReasoningSpec(), 10, tools=(tool,))
    assert len(seen) == 3


@pytest.mark.parametrize("arguments", ['{"city": ', "[1, 2]", '"Paris"', "null", ""])
def test_call_arguments_that_are_not_a_json_object_are_rejected(
    hf: Any, arguments: str
) -> None:
    messages = (
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("a", "get_weather", arguments),)),
        ChatMessage("tool", "ok", tool_call_id="a", name="get_weather"),
    )
    with pytest.raises(InvalidRequestError) as err:
        render_prompt(hf, ChatPrompt(messages), ReasoningSpec(), len(hf))
    assert err.value.param == "messages"


def test_tool_parameters_that_are_not_json_are_rejected(hf: Any) -> None:
    prompt = ChatPrompt((ChatMessage("user", "Hi"),))
    with pytest.raises(InvalidRequestError) as err:
        render_prompt(hf, prompt, ReasoningSpec(), len(hf), tools=(ToolSpec("f", None, "{"),))
    assert err.value.param == "tools"
