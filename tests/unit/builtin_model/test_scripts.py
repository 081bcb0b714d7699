"""The built-in models' scripts: what the tests need from them, text shapes, invalid ones."""

from __future__ import annotations

import json
from typing import Any

import pytest

from replicas.builtin import load_scripts, script
from replicas.builtin.scripts import parse_scripts


def test_scripts_cover_what_the_tests_need() -> None:
    scripts = load_scripts()
    assert 16 <= len(scripts) <= 30
    assert len({s.id for s in scripts}) == len(scripts)
    reasoning = [s for s in scripts if s.reasoning]
    assert len(reasoning) >= 3
    assert {s.kind for s in scripts} == {"chat", "completion"}
    riddle = script("riddle-think")
    assert riddle.reasoning is not None
    assert "Check:" in riddle.reasoning and "Check:" not in riddle.answer
    assert "Hmm," in riddle.reasoning and "Hmm," not in riddle.answer
    assert "piano" in riddle.reasoning and "piano" in riddle.answer
    # Every reasoning script whose prompt also appears with thinking off answers the same.
    # (The tool scripts are off so that Anthropic's path, which thinks only when asked,
    # reaches them; they have no reasoning twin.)
    pairs = [(off, twin) for off in scripts if off.enable_thinking is False
             for twin in reasoning if twin.messages == off.messages]
    assert {off.id for off, _ in pairs} >= {"riddle-nothink", "feathers-nothink"}
    for off, twin in pairs:
        assert twin.answer == off.answer
    assert "\n\n" in script("two-paragraphs").answer
    assert "\n" in script("haiku").answer and "\n\n" not in script("haiku").answer
    json.loads(script("json-record").answer)
    with pytest.raises(ValueError):
        json.loads(script("profile-prose").answer)


def test_expected_text_shapes() -> None:
    riddle = script("riddle-think")
    assert riddle.expected_text == f"<think>\n{riddle.reasoning}\n</think>\n\n{riddle.answer}"
    assert script("riddle-nothink").expected_text == riddle.answer
    count = script("count-completion")
    assert count.prompt == "Count from 1 to 10, one number per line:\n1\n2\n"
    assert count.expected_text == "3\n4\n5\n6\n7\n8\n9\n10"
    assert script("hello").template_kwargs == {}
    assert script("riddle-nothink").template_kwargs == {"enable_thinking": False}
    with pytest.raises(KeyError, match="no script"):
        script("no-such-script")


def one_script_json(**fields: Any) -> str:
    entry = {
        "id": "x",
        "kind": "chat",
        "messages": [{"role": "user", "content": "Hi"}],
        "answer": "Hello.",
        **fields,
    }
    return json.dumps({"scripts": [entry]})


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"enable_thinking": False, "reasoning": "r"}, "no room for reasoning"),
        ({"kind": "completion"}, "has a prompt and no messages"),
        ({"kind": "other"}, "kind must be"),
        ({"answer": ""}, "answer must be"),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "last message"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "message roles"),
        ({"reasoning": ""}, "reasoning must be"),
        ({"enable_thinking": 1}, "enable_thinking must be"),
    ],
)
def test_invalid_scripts_are_rejected(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_scripts(one_script_json(**fields))


def test_duplicate_ids_are_rejected() -> None:
    entry = json.loads(one_script_json())["scripts"][0]
    with pytest.raises(ValueError, match="duplicate"):
        parse_scripts(json.dumps({"scripts": [entry, entry]}))
