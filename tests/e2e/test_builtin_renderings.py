"""The built-in model answers its scripts in every rendering the three APIs produce, over a
real `serve run` with the official SDKs (issue 24 item 7): Anthropic renders thinking off
unless `thinking` is on, OpenAI chat the template default (thinking on) unless
`chat_template_kwargs` say otherwise, Responses the default unless `reasoning.effort` is
"none". And the README's quick-start examples run as written and print the scripted answer.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from replicas.builtin import load_scripts, script
from replicas.builtin.scripts import Script

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
ROOT = Path(__file__).resolve().parents[2]
README_PROMPT = "List five of the largest cities in the world."
# Chats without tools (the tool scripts have their own tests in both thinking modes).
PLAIN_CHATS = [s.id for s in load_scripts() if s.kind == "chat" and not s.tools]
THINKING = {"type": "enabled", "budget_tokens": 200}
# The anthropic SDK has no `temperature` argument (the API has the field).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_args(s: Script, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 400, "extra_body": GREEDY,
                            "messages": [m for m in s.message_dicts if m["role"] != "system"]}
    system = [m["content"] for m in s.message_dicts if m["role"] == "system"]
    if system:
        body["system"] = system[0]
    return {**body, **extra}


def blocks(message: Any, kind: str) -> str:
    return "".join(getattr(b, kind) for b in message.content if b.type == kind)


def test_the_readme_prompt_through_the_anthropic_sdk(claude: anthropic.Anthropic) -> None:
    answer = script("cities").answer
    assert script("cities").messages[0].content == README_PROMPT
    message = claude.messages.create(
        model=MODEL, max_tokens=200, extra_body=GREEDY,
        messages=[{"role": "user", "content": README_PROMPT}])
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == answer and message.stop_reason == "end_turn"
    with claude.messages.stream(model=MODEL, max_tokens=200, extra_body=GREEDY,
                                messages=[{"role": "user", "content": README_PROMPT}]) as stream:
        assert "".join(stream.text_stream) == answer
    cut = claude.messages.create(
        model=MODEL, max_tokens=200, extra_body=GREEDY, stop_sequences=["3."],
        messages=[{"role": "user", "content": README_PROMPT}])
    assert cut.content[0].text == answer[: answer.index("3.")]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "3.")
    # With thinking on, a script without reasoning answers straight away.
    thought = claude.messages.create(
        model=MODEL, max_tokens=400, extra_body=GREEDY, thinking=THINKING,
        messages=[{"role": "user", "content": README_PROMPT}])
    assert blocks(thought, "thinking") == "" and blocks(thought, "text") == answer


def test_the_readme_prompt_through_the_openai_sdk(oai: openai.OpenAI) -> None:
    answer = script("cities").answer
    messages = [{"role": "user", "content": README_PROMPT}]
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}},
                  {"chat_template_kwargs": {"enable_thinking": True}}):
        r = oai.chat.completions.create(model=MODEL, temperature=0, messages=messages,  # type: ignore[arg-type]
                                        extra_body=extra)
        assert r.choices[0].message.content == answer, extra
        assert r.choices[0].finish_reason == "stop"
    for reasoning in (None, {"effort": "none"}, {"effort": "low"}):
        args: dict[str, Any] = {"reasoning": reasoning} if reasoning else {}
        response = oai.responses.create(model=MODEL, temperature=0, input=README_PROMPT, **args)
        assert response.output_text == answer, reasoning


@pytest.mark.parametrize("sid", ["riddle-think", "feathers-think", "sum-think"])
def test_a_reasoning_script_thinks_only_when_asked(claude: anthropic.Anthropic,
                                                   oai: openai.OpenAI, sid: str) -> None:
    s = script(sid)
    assert s.reasoning
    plain = claude.messages.create(**anthropic_args(s))
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == s.answer
    thought = claude.messages.create(**anthropic_args(s, thinking=THINKING))
    assert [b.type for b in thought.content] == ["thinking", "text"]
    assert blocks(thought, "thinking") == s.reasoning and blocks(thought, "text") == s.answer
    with claude.messages.stream(**anthropic_args(s, thinking=THINKING)) as stream:
        final = stream.get_final_message()
    assert blocks(final, "thinking") == s.reasoning and blocks(final, "text") == s.answer
    # The OpenAI SDK: thinking on by default, off when the kwarg says so.
    on = oai.chat.completions.create(model=MODEL, temperature=0, messages=s.message_dicts)  # type: ignore[arg-type]
    assert on.choices[0].message.content == s.answer
    assert on.choices[0].message.model_extra["reasoning_content"] == s.reasoning
    off = oai.chat.completions.create(
        model=MODEL, temperature=0, messages=s.message_dicts,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == s.answer
    assert off.choices[0].message.model_extra.get("reasoning_content") is None


@pytest.mark.parametrize("sid", PLAIN_CHATS)
def test_every_plain_chat_in_both_anthropic_renderings(claude: anthropic.Anthropic,
                                                       sid: str) -> None:
    s = script(sid)
    plain = claude.messages.create(**anthropic_args(s))
    assert blocks(plain, "text") == s.answer and blocks(plain, "thinking") == ""
    thought = claude.messages.create(**anthropic_args(s, thinking=THINKING))
    # The prompt's thinking-on answer: the script's own, or its reasoning twin's.
    twins = [t for t in load_scripts() if t.messages == s.messages and t.reasoning]
    assert blocks(thought, "thinking") == (twins[0].reasoning if twins else "")
    assert blocks(thought, "text") == s.answer


def _readme_examples() -> list[str]:
    """The quick start's Python examples, in order."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quick start")
    section = readme[start:readme.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_readme_examples_run_as_written(server: str) -> None:
    examples = _readme_examples()
    assert [("from openai" in e, "from anthropic" in e) for e in examples] == [
        (True, False), (False, True)]
    printed = []
    for example in examples:
        assert "http://127.0.0.1:8000" in example
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(example.replace("http://127.0.0.1:8000", server), {})  # noqa: S102
        printed.append(out.getvalue())
    head = script("cities").answer[: script("cities").answer.index("3.")]
    assert head.endswith("2. Delhi\n")
    assert printed == [f"{head} stop\n", f"{head} stop_sequence 3.\n"]
