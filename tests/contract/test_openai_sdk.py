"""The OpenAI adapter, driven by the official `openai` SDK against the real app and a fake client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GuidedSpec,
    OutputEvent,
    ReasoningSpec,
    TextDelta,
    TextPrompt,
    Usage,
)
from replicas.errors import ContextLengthError, OverloadedError
from tests.fakes import FakeClient

USAGE = Usage(prompt_tokens=7, completion_tokens=9, reasoning_tokens=3)
REASONED: list[OutputEvent] = [
    TextDelta(Channel.REASONING, "Think "),
    TextDelta(Channel.REASONING, "hard."),
    TextDelta(Channel.ANSWER, "1. Tokyo\n"),
    TextDelta(Channel.ANSWER, "2. Delhi"),
    Finished(FinishReason.STOP_SEQUENCE, USAGE, "\n3."),
]


def sdk(fake: FakeClient) -> tuple[openai.OpenAI, TestClient]:
    http = TestClient(create_app(fake))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0), http


def chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="orchard-tiny", messages=[{"role": "user", "content": "hi"}], **extra)


@pytest.mark.parametrize("cut", range(len(REASONED) + 1))
def test_streamed_deltas_equal_the_body_for_every_batch_split(cut: int) -> None:
    client, _ = sdk(FakeClient(REASONED, cuts=[cut] if 0 < cut < len(REASONED) else None))
    body = chat(client)
    chunks = list(chat(client, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks if c.choices)
    message = body.choices[0].message
    assert message.content == content == "1. Tokyo\n2. Delhi"
    assert message.model_extra["reasoning_content"] == reasoning == "Think hard."
    final = chunks[-1].choices[0]
    assert body.choices[0].finish_reason == final.finish_reason == "stop"
    assert body.choices[0].model_extra["matched_stop"] == final.model_extra["matched_stop"] == "\n3."
    assert body.usage.completion_tokens_details.reasoning_tokens == 3


@pytest.mark.parametrize(
    ("reason", "stop", "finish", "matched"),
    [
        (FinishReason.EOS, None, "stop", None),
        (FinishReason.STOP_SEQUENCE, "END", "stop", "END"),
        (FinishReason.STOP_TOKEN, 42, "stop", 42),
        (FinishReason.LENGTH, None, "length", None),
        (FinishReason.GRAMMAR_COMPLETE, None, "stop", None),
    ],
)
def test_finish_reason_table(reason: FinishReason, stop: Any, finish: str, matched: Any) -> None:
    client, _ = sdk(FakeClient([TextDelta(Channel.ANSWER, "x"), Finished(reason, USAGE, stop)]))
    choice = chat(client).choices[0]
    assert choice.finish_reason == finish
    assert choice.model_extra["matched_stop"] == matched
    assert choice.model_extra["stop_reason"] == matched


def test_usage_chunk_and_done() -> None:
    _, http = sdk(FakeClient(REASONED))
    r = http.post("/v1/chat/completions", json={
        "model": "orchard-tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}})
    frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    last = json.loads(frames[-2])
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 16


def test_completions_map_to_a_text_prompt() -> None:
    fake = FakeClient([TextDelta(Channel.ANSWER, "3\n4"), Finished(FinishReason.EOS, USAGE)])
    client, _ = sdk(fake)
    body = client.completions.create(model="tiny", prompt="1\n2\n", stop="5", max_tokens=9)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="1\n2\n", stream=True) if c.choices)
    assert body.choices[0].text == streamed == "3\n4"
    request = fake.requests[0]
    assert request.prompt == TextPrompt("1\n2\n") and request.stop.strings == ("5",)
    assert request.sampling.max_tokens == 9 and request.model == "orchard-tiny"


def test_failure_before_any_text_is_an_http_error() -> None:
    client, _ = sdk(FakeClient([ContextLengthError("too long", param="max_tokens")]))
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"


def test_overload_is_503_with_retry_after() -> None:
    _, http = sdk(FakeClient([OverloadedError("busy")]))
    r = http.post("/v1/chat/completions", json={
        "model": "orchard-tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded_error"


def test_failure_mid_stream_is_an_error_frame() -> None:
    events = [TextDelta(Channel.ANSWER, "partial"), Failed(ErrorKind.INTERNAL, "engine fault")]
    _, http = sdk(FakeClient(events))
    r = http.post("/v1/chat/completions", json={
        "model": "orchard-tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(frames[-1])["error"]["message"] == "engine fault"
    assert "[DONE]" not in frames


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, GuidedSpec("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object"}, "strict": True}}},
         GuidedSpec("json_schema", '{"type": "object"}', True)),
        ({"extra_body": {"guided_choice": ["a", "b"]}}, GuidedSpec("choice", ("a", "b"))),
        ({"extra_body": {"guided_regex": "[0-9]+"}}, GuidedSpec("regex", "[0-9]+")),
    ],
)
def test_guided_options_map_to_one_spec(extra: dict[str, Any], expected: GuidedSpec) -> None:
    fake = FakeClient([Finished(FinishReason.GRAMMAR_COMPLETE, USAGE)])
    client, _ = sdk(fake)
    chat(client, **extra)
    assert fake.requests[0].guided == expected


def test_reasoning_options_reach_the_request() -> None:
    fake = FakeClient([Finished(FinishReason.EOS, USAGE)])
    client, _ = sdk(fake)
    chat(client, reasoning_effort="low", extra_body={
        "chat_template_kwargs": {"enable_thinking": False, "x": 1}, "thinking_budget": 50})
    reasoning = fake.requests[0].reasoning
    assert reasoning.enabled is False and reasoning.budget_tokens == 50
    assert reasoning.effort == "low" and dict(reasoning.template_kwargs) == {"x": 1}


@pytest.mark.parametrize(("effort", "expected"), [
    ("none", ReasoningSpec(enabled=False)),
    ("minimal", ReasoningSpec(enabled=False)),
    ("low", ReasoningSpec(enabled=True, budget_tokens=1024, effort="low")),
    ("xhigh", ReasoningSpec(enabled=True, budget_tokens=32768, effort="high")),
    (None, ReasoningSpec()),
])
def test_reasoning_effort_means_what_it_means_on_the_responses_route(
        effort: str | None, expected: ReasoningSpec) -> None:
    fake = FakeClient([Finished(FinishReason.EOS, USAGE)])
    client, _ = sdk(fake)
    chat(client, **({} if effort is None else {"reasoning_effort": effort}))
    client.responses.create(model="orchard-tiny", input="hi", reasoning={"effort": effort})
    chat_request, responses_request = fake.requests
    assert chat_request.reasoning == responses_request.reasoning == expected


def test_explicit_thinking_switches_beat_the_effort() -> None:
    fake = FakeClient([Finished(FinishReason.EOS, USAGE)])
    client, _ = sdk(fake)
    chat(client, reasoning_effort="none",
         extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget": 9})
    assert fake.requests[0].reasoning == ReasoningSpec(enabled=True, budget_tokens=9)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
          "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", ""]}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "guided_regex": "a",
          "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"},
         "reasoning_effort"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ],
)
def test_invalid_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    fake = FakeClient([Finished(FinishReason.EOS, USAGE)])
    _, http = sdk(fake)
    r = http.post("/v1/chat/completions", json={"model": "orchard-tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert fake.requests == []  # rejected before any model time


def test_models_list_includes_aliases() -> None:
    client, _ = sdk(FakeClient())
    assert [m.id for m in client.models.list().data] == ["orchard-tiny", "tiny"]


HUB_ID = "mlx-community/Qwen3-4B"  # a Hub id: its slash is part of the model id


def test_models_retrieve_returns_the_listed_entry() -> None:
    cards = (ModelCard("orchard-tiny", aliases=("tiny",), context_length=4096),
             ModelCard(HUB_ID, owned_by="mlx-community", created=1700000000))
    client, http = sdk(FakeClient(models=cards))
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == ["orchard-tiny", "tiny", HUB_ID]
    for name, entry in listed.items():
        assert client.models.retrieve(name) == entry  # the SDK sends the slash as %2F
    # An alias is its own entry, whose `root` is the served id.
    assert client.models.retrieve("tiny").model_extra["root"] == "orchard-tiny"
    # Clients that send the slash raw reach the same route.
    raw = http.get(f"/v1/models/{HUB_ID}")
    assert raw.status_code == 200
    entry = raw.json()
    assert entry == http.get("/v1/models").json()["data"][2]
    assert {k: entry[k] for k in ("id", "object", "created", "owned_by", "root")} == {
        "id": HUB_ID, "object": "model", "created": 1700000000, "owned_by": "mlx-community",
        "root": HUB_ID}


@pytest.mark.parametrize("name", ["nope", "mlx-community/nope", "orchard-tiny/extra"])
def test_models_retrieve_of_an_unknown_id_is_a_404_in_openais_shape(name: str) -> None:
    client, http = sdk(FakeClient())
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)
    r = http.get(f"/v1/models/{name}")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error == {"message": error["message"], "type": "not_found_error", "param": "model",
                     "code": "not_found"}
    assert f"'{name}'" in error["message"]
    # The same error as an unknown model on a generation route.
    unknown = http.post("/v1/chat/completions", json={
        "model": name, "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404 and unknown.json() == r.json()


def test_a_replica_failure_event_keeps_the_offending_field() -> None:
    failed = Failed(ErrorKind.CONTEXT_LENGTH, "prompt plus max_tokens is too long", "max_tokens")
    _, http = sdk(FakeClient([failed]))
    r = http.post("/v1/chat/completions", json={
        "model": "orchard-tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "context_length_exceeded"
