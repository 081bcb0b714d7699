"""Every rendering the three APIs produce for a chat script is one the tiny model is trained
and verified on (`scripts.renderings`): each script sent through the OpenAI chat, Anthropic
messages and Responses converters, with each thinking switch they know, renders exactly the
prompt ids of a trained rendering, whose text is the script's answer (with its reasoning
only where thinking is on)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ingress.anthropic.convert import to_generation_request
from ingress.anthropic.models import MessagesRequest
from ingress.client import ModelCard
from ingress.openai.convert import chat_request
from ingress.openai.models import ChatCompletionRequest
from ingress.responses.convert import to_plan
from ingress.responses.models import ResponsesRequest
from replicas.builtin import load_scripts, script
from replicas.builtin.scripts import Rendering, Script, parse_scripts, renderings
from replicas.builtin.tokenizer_files import prompt_ids
from replicas.contract import GenerationRequest
from replicas.pipeline.prompt import render_prompt

CARD = ModelCard("orchard-tiny")
CHATS = [s.id for s in load_scripts() if s.kind == "chat"]


def openai_request(s: Script, switch: dict[str, Any] | None) -> GenerationRequest:
    """`switch`: the body's thinking fields (`chat_template_kwargs`, `reasoning_effort`)."""
    body = {"model": CARD.id, "messages": s.message_dicts, **(switch or {})}
    if s.tools:
        body["tools"] = s.tool_dicts
    return chat_request(ChatCompletionRequest.model_validate(body), CARD.id)


def anthropic_request(s: Script, thinking: dict[str, Any] | None) -> GenerationRequest:
    """The script as the anthropic SDK sends it: system apart, calls as tool_use blocks,
    a run of tool results as one user turn of tool_result blocks."""
    body: dict[str, Any] = {"model": CARD.id, "max_tokens": 400, "messages": []}
    messages: list[dict[str, Any]] = body["messages"]
    for m in s.messages:
        if m.role == "system":
            body["system"] = m.content
        elif m.role == "tool":
            result = {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content}
            if messages and messages[-1]["role"] == "user" and isinstance(
                    messages[-1]["content"], list):
                messages[-1]["content"].append(result)
            else:
                messages.append({"role": "user", "content": [result]})
        elif m.tool_calls:
            blocks: list[dict[str, Any]] = [{"type": "text", "text": m.content}] if m.content \
                else []
            blocks += [{"type": "tool_use", "id": c.id, "name": c.name,
                        "input": json.loads(c.arguments)} for c in m.tool_calls]
            messages.append({"role": m.role, "content": blocks})
        else:
            messages.append({"role": m.role, "content": m.content})
    if s.tools:
        body["tools"] = [{"name": t["function"]["name"],
                          "description": t["function"]["description"],
                          "input_schema": t["function"]["parameters"]} for t in s.tool_dicts]
    if thinking is not None:
        body["thinking"] = thinking
    return to_generation_request(MessagesRequest.model_validate(body), CARD)


def responses_request(s: Script, reasoning: dict[str, Any] | None) -> GenerationRequest:
    """The script as Responses input items: messages, function_call and
    function_call_output items."""
    items: list[dict[str, Any]] = []
    for m in s.messages:
        if m.role == "tool":
            items.append({"type": "function_call_output", "call_id": m.tool_call_id,
                          "output": m.content})
            continue
        if m.content or not m.tool_calls:
            items.append({"type": "message", "role": m.role, "content": m.content})
        items += [{"type": "function_call", "call_id": c.id, "name": c.name,
                   "arguments": c.arguments} for c in m.tool_calls]
    body: dict[str, Any] = {"model": CARD.id, "input": items, "reasoning": reasoning}
    if s.tools:
        body["tools"] = [{"type": "function", "name": t["function"]["name"],
                          "description": t["function"]["description"],
                          "parameters": t["function"]["parameters"], "strict": False}
                         for t in s.tool_dicts]
    return to_plan(ResponsesRequest.model_validate(body), CARD).generation


# (API, switch, thinking on?) for every thinking switch each API has.
VARIANTS = [
    ("openai", None, True),  # the template default
    ("openai", {"chat_template_kwargs": {"enable_thinking": True}}, True),
    ("openai", {"chat_template_kwargs": {"enable_thinking": False}}, False),
    ("openai", {"reasoning_effort": "none"}, False),
    ("openai", {"reasoning_effort": "minimal"}, False),
    ("openai", {"reasoning_effort": "low"}, True),
    ("anthropic", None, False),  # Anthropic does not think unless asked
    ("anthropic", {"type": "disabled"}, False),
    ("anthropic", {"type": "enabled", "budget_tokens": 100}, True),
    ("anthropic", {"type": "adaptive"}, True),
    ("responses", None, True),  # no `reasoning`: the template default
    ("responses", {"effort": "none"}, False),
    ("responses", {"effort": "minimal"}, False),
    ("responses", {"effort": "low"}, True),
]
BUILD = {"openai": openai_request, "anthropic": anthropic_request,
         "responses": responses_request}


def trained(s: Script, thinking: bool) -> Rendering:
    """The trained rendering with this script's prompt and thinking switch."""
    key = (s.kind, s.messages, s.prompt, s.tools, thinking)
    (found,) = [r for r in renderings(load_scripts()) if r.key() == key]
    return found


@pytest.mark.parametrize("sid", CHATS)
def test_every_api_rendering_is_a_trained_one(hf: Any, sid: str) -> None:
    s = script(sid)
    for api, switch, thinking in VARIANTS:
        request = BUILD[api](s, switch)
        got = list(render_prompt(hf, request.prompt, request.reasoning, len(hf),
                                 tools=request.tools).token_ids)
        rendering = trained(s, thinking)
        assert got == prompt_ids(hf, rendering), (api, switch)
        if thinking:  # reasoning when the script (or its thinking twin) has some
            assert rendering.text.endswith(s.answer), (api, switch)
        else:
            assert rendering.text == s.answer, (api, switch)


def test_the_rendering_rule() -> None:
    scripts = load_scripts()
    by_label = {r.label: r for r in renderings(scripts)}
    assert len(by_label) == len(renderings(scripts))
    # A script's own rendering keeps `expected_text` and `template_kwargs`.
    for s in scripts:
        own = by_label[s.id]
        assert (own.text, own.template_kwargs, own.derived) == (
            s.expected_text, s.template_kwargs, False)
    # Thinking on by default: also trained with thinking off, answer only.
    off = by_label["cities@thinking-off"]
    assert off.template_kwargs == {"enable_thinking": False} and off.text == script("cities").answer
    assert by_label["sum-think@thinking-off"].text == script("sum-think").answer
    # Thinking off: also trained with thinking on (no kwarg), the same answer.
    on = by_label["tool-one@thinking-on"]
    assert on.template_kwargs == {} and on.text == script("tool-one").expected_text
    # A prompt another script names as its own is that script's: no twin of the riddles.
    for twin in ("riddle-think@thinking-off", "riddle-nothink@thinking-on",
                 "feathers-think@thinking-off", "feathers-nothink@thinking-on"):
        assert twin not in by_label
    # Completions have one rendering.
    assert [r.label for r in renderings(scripts) if r.script.kind == "completion"] == [
        s.id for s in scripts if s.kind == "completion"]
    # Every chat prompt is trained both ways.
    chats = [s for s in scripts if s.kind == "chat"]
    keys = {r.key() for r in renderings(scripts)}
    for s in chats:
        for thinking in (True, False):
            assert (s.kind, s.messages, s.prompt, s.tools, thinking) in keys, s.id


def test_two_scripts_naming_one_prompt_are_rejected() -> None:
    def entry(sid: str, thinking: bool | None) -> dict[str, Any]:
        return {"id": sid, "kind": "chat", "messages": [{"role": "user", "content": "Hi"}],
                "enable_thinking": thinking, "answer": "Hello."}

    # null and true render the same prompt (thinking on).
    with pytest.raises(ValueError, match="render the same prompt"):
        parse_scripts(json.dumps({"scripts": [entry("a", None), entry("b", True)]}))
    both = parse_scripts(json.dumps({"scripts": [entry("a", None), entry("b", False)]}))
    assert [r.label for r in renderings(both)] == ["a", "b"]
