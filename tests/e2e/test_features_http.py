"""Reasoning channels and guided decoding over real HTTP, with the openai SDK."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from replicas.builtin import script
from tests.e2e.test_openai_http import chat_args, stream_chat

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def json_schema_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stop", [None, ['"', ","]])
def test_json_schema_on_a_prose_prompt(client: openai.OpenAI, stop: list[str] | None) -> None:
    args = chat_args("profile-prose", response_format=json_schema_format(), stop=stop)
    body = client.chat.completions.create(**args)
    content, _, final = stream_chat(client, **args)
    assert body.choices[0].message.content == content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert body.choices[0].finish_reason == final.finish_reason == "stop"


def test_json_object_choice_and_regex(client: openai.OpenAI) -> None:
    # The script whose answer is a JSON object: the grammar lets the model say it as is
    # (off-script text, e.g. "hello"'s, need not close within max_tokens).
    obj = client.chat.completions.create(**chat_args("json-record", response_format={"type": "json_object"}))
    assert json.loads(obj.choices[0].message.content) == json.loads(script("json-record").answer)
    choice = client.chat.completions.create(**chat_args("hello", extra_body={"guided_choice": ["yes", "no"]}))
    assert choice.choices[0].message.content in {"yes", "no"}
    regex = client.chat.completions.create(**chat_args("hello", extra_body={"guided_regex": "[a-c]{4}"}))
    assert len(regex.choices[0].message.content) == 4 and set(regex.choices[0].message.content) <= set("abc")


def test_invalid_schema_is_a_400(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**chat_args("hello", response_format=bad))


def test_stop_only_in_reasoning_does_not_fire(client: openai.OpenAI) -> None:
    s = script("riddle-think")
    assert "Check:" in (s.reasoning or "") and "Check:" not in s.answer
    body = client.chat.completions.create(**chat_args("riddle-think", stop=["Check:"]))
    content, reasoning, final = stream_chat(client, **chat_args("riddle-think", stop=["Check:"]))
    message = body.choices[0].message
    assert message.content == content == s.answer
    assert message.model_extra["reasoning_content"] == reasoning == s.reasoning
    assert body.choices[0].model_extra["matched_stop"] is None
    assert body.usage.completion_tokens_details.reasoning_tokens > 0


def test_stop_in_the_answer_cuts_only_the_answer(client: openai.OpenAI) -> None:
    s = script("riddle-think")
    body = client.chat.completions.create(**chat_args("riddle-think", stop=["piano"]))
    message = body.choices[0].message
    assert message.model_extra["reasoning_content"] == s.reasoning  # "piano" occurs there too
    assert message.content == s.answer[: s.answer.index("piano")]
    assert body.choices[0].model_extra["matched_stop"] == "piano"


def test_enable_thinking_false_has_no_reasoning(client: openai.OpenAI) -> None:
    args = chat_args("riddle-think", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    body = client.chat.completions.create(**args)
    assert body.choices[0].message.model_extra.get("reasoning_content") is None
    assert body.choices[0].message.content == script("riddle-nothink").answer


# "\n</think>\n\n" in the built-in tokenizer: what a spent budget forces, at most 3 tokens.
FORCED_END_TOKENS = 3


def test_thinking_budget_cuts_reasoning_at_the_budget_and_still_answers(
    client: openai.OpenAI
) -> None:
    budget = 10
    s = script("feathers-think")  # 144 reasoning tokens: far past the budget
    assert s.reasoning is not None
    args = chat_args("feathers-think", max_tokens=200, extra_body={"thinking_budget": budget})
    body = client.chat.completions.create(**args)
    message = body.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    # Reasoning happened, and was cut, not rewritten: a strict prefix of the script's.
    assert reasoning and s.reasoning.startswith(reasoning), reasoning
    assert len(reasoning) < len(s.reasoning) / 2
    spent = body.usage.completion_tokens_details.reasoning_tokens
    assert budget <= spent <= budget + FORCED_END_TOKENS, spent
    # The answer still arrives, outside the reasoning and free of its markers.
    assert message.content and message.content.strip()
    assert "think>" not in message.content and "think>" not in reasoning
    assert body.usage.completion_tokens > spent
    content, streamed_reasoning, final = stream_chat(client, **args)
    assert (content, streamed_reasoning) == (message.content, reasoning)
    assert final.finish_reason == body.choices[0].finish_reason

    # Without a budget the same prompt thinks to the end: the budget is what cut it.
    free = client.chat.completions.create(**chat_args("feathers-think"))
    assert free.choices[0].message.model_extra["reasoning_content"] == s.reasoning
