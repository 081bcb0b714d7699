"""`tool_choice: none` over `serve run` with the official SDKs: the built-in model wants to
call on these scripts, and with `<tool_call>` banned it writes the call's body and
`</tool_call>` anyway; no marker of its (Hermes) format may reach the text, streamed or
not, and no call comes back."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from replicas.builtin import script

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
# The Hermes markers: the call's delimiters and the tool-result wrapper.
MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CALLING = ["tool-one", "tool-parallel", "tool-text-then-call", "tool-after-reasoning"]


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def leaked(text: str) -> list[str]:
    return [m for m in MARKERS if m in text]


def chat_args(sid: str) -> dict[str, Any]:
    s = script(sid)
    args: dict[str, Any] = {"model": MODEL, "messages": s.message_dicts, "temperature": 0,
                            "max_tokens": 200, "tools": s.tool_dicts, "tool_choice": "none"}
    if s.enable_thinking is not None:
        args["extra_body"] = {"chat_template_kwargs": {"enable_thinking": s.enable_thinking}}
    return args


@pytest.mark.parametrize("sid", CALLING)
def test_openai_none_lets_no_marker_into_content_streamed_or_not(
        oai: openai.OpenAI, sid: str) -> None:
    full = oai.chat.completions.create(**chat_args(sid)).choices[0]
    deltas: list[str] = []
    with oai.chat.completions.stream(**chat_args(sid)) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                delta = event.chunk.choices[0].delta
                assert not delta.tool_calls, delta
                deltas.append(delta.content or "")
        final = stream.get_final_completion().choices[0]
    content, streamed = full.message.content or "", "".join(deltas)
    assert (leaked(content), leaked(streamed)) == ([], []), (content, deltas)
    assert content and streamed == content
    assert not full.message.tool_calls and not final.message.tool_calls
    assert full.finish_reason in ("stop", "length") and final.finish_reason == full.finish_reason


@pytest.mark.parametrize("sid", CALLING)
def test_anthropic_none_lets_no_marker_into_text_streamed_or_not(
        claude: anthropic.Anthropic, sid: str) -> None:
    s = script(sid)
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 200, "messages": s.message_dicts,
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                  for t in s.tool_dicts],
        "tool_choice": {"type": "none"}, "extra_body": {"temperature": 0}}
    full = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    text = "".join(b.text for b in full.content if b.type == "text")
    assert (leaked(text), leaked(streamed)) == ([], []), (text, streamed)
    assert text and streamed == text
    assert [b.type for b in full.content] == [b.type for b in final.content] == ["text"]
    assert full.stop_reason in ("end_turn", "max_tokens")
