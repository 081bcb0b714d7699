"""A model's config-level `thinking_budget` and `default_stops` over HTTP, on the cluster's
`orchard-defaults` model (its settings: `DEFAULTS_SETTINGS` in cluster.py).

The budget applies when a request names none and is cut exactly (reasoning tokens == the
budget, plus the forced end-of-reasoning tokens), and a request's own budget wins. Default
stops merge with a request's stops: whichever matches first ends the answer and is the one
reported; they never fire inside reasoning.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from replicas.builtin import script
from tests.reliability.cluster import DEFAULTS, DEFAULTS_SETTINGS, SOLO, auth_headers

pytestmark = pytest.mark.reliability

BUDGET: int = DEFAULTS_SETTINGS["thinking_budget"]
# "\n</think>\n\n" in the built-in tokenizer: what a spent budget forces, at most 3 tokens.
FORCED_END_TOKENS = 3


@pytest.fixture(scope="module")
def http(cluster: str) -> httpx.Client:
    return httpx.Client(base_url=cluster, headers=auth_headers(), timeout=60)


def chat(http: httpx.Client, sid: str, model: str = DEFAULTS.model, **extra: Any) -> Any:
    body = {"model": model, "messages": script(sid).message_dicts, "temperature": 0,
            "max_tokens": 300, **extra}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def anthropic_cities() -> dict[str, Any]:
    # Anthropic turns thinking off unless asked, a prompt the script was not made with;
    # enabled, the model answers `cities` without reasoning, as scripted.
    return {"model": DEFAULTS.model, "messages": script("cities").message_dicts,
            "max_tokens": 300, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 100}}


def test_config_budget_cuts_reasoning_at_the_budget_and_still_answers(
    http: httpx.Client
) -> None:
    s = script("feathers-think")
    assert s.reasoning is not None
    body = chat(http, "feathers-think")
    message = body["choices"][0]["message"]
    reasoning = message["reasoning_content"]
    assert reasoning and s.reasoning.startswith(reasoning), reasoning  # cut, not rewritten
    assert len(reasoning) < len(s.reasoning) / 2
    spent = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert BUDGET <= spent <= BUDGET + FORCED_END_TOKENS, spent
    assert message["content"].strip() and "think>" not in message["content"]
    assert body["choices"][0]["finish_reason"] == "stop"

    # The same prompt on a model without the setting thinks to the end.
    free = chat(http, "feathers-think", model=SOLO.model)
    assert free["choices"][0]["message"]["reasoning_content"] == s.reasoning
    assert free["usage"]["completion_tokens_details"]["reasoning_tokens"] > 100


def test_config_budget_reaches_every_api(http: httpx.Client) -> None:
    s = script("feathers-think")
    assert s.reasoning is not None
    # Adaptive thinking names no budget: the model's default applies.
    anthropic = http.post("/v1/messages", json={
        "model": DEFAULTS.model, "messages": s.message_dicts, "max_tokens": 300,
        "temperature": 0, "thinking": {"type": "adaptive"}}).json()
    thinking = [b["thinking"] for b in anthropic["content"] if b["type"] == "thinking"]
    assert len(thinking) == 1 and s.reasoning.startswith(thinking[0]), anthropic
    assert len(thinking[0]) < len(s.reasoning) / 2
    assert [b["text"] for b in anthropic["content"] if b["type"] == "text"][0].strip()

    responses = http.post("/v1/responses", json={
        "model": DEFAULTS.model, "input": s.message_dicts, "max_output_tokens": 300,
        "temperature": 0, "store": False}).json()
    assert responses["status"] == "completed", responses
    spent = responses["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert BUDGET <= spent <= BUDGET + FORCED_END_TOKENS, responses["usage"]


def test_a_request_budget_overrides_the_config_one(http: httpx.Client) -> None:
    s = script("riddle-think")  # 33 reasoning tokens: past the config's budget
    body = chat(http, "riddle-think", thinking_budget=200)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == s.reasoning
    assert message["content"] == s.answer

    smaller = chat(http, "feathers-think", thinking_budget=5)
    assert 5 <= smaller["usage"]["completion_tokens_details"]["reasoning_tokens"] \
        <= 5 + FORCED_END_TOKENS


def test_default_stops_apply_without_request_stops(http: httpx.Client) -> None:
    answer = script("cities").answer
    body = chat(http, "cities")
    choice = body["choices"][0]
    assert choice["message"]["content"] == answer[: answer.index("3.")]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "3."

    anthropic = http.post("/v1/messages", json=anthropic_cities()).json()
    assert anthropic["stop_reason"] == "stop_sequence" and anthropic["stop_sequence"] == "3."
    assert anthropic["content"][0]["text"] == answer[: answer.index("3.")]

    # The Responses API has no stop parameter; the model's defaults still hold.
    responses = http.post("/v1/responses", json={
        "model": DEFAULTS.model, "input": script("cities").message_dicts,
        "max_output_tokens": 300, "temperature": 0, "store": False}).json()
    texts = [p["text"] for item in responses["output"] if item["type"] == "message"
             for p in item["content"]]
    assert texts == [answer[: answer.index("3.")]], responses


@pytest.mark.parametrize("stop, cut_at", [
    (["Tokyo"], "Tokyo"),  # the request's stop comes first: it wins
    (["Shanghai"], "3."),  # the default comes first: it wins, the request's is still merged
    (["3."], "3."),  # the same string in both: one stop, reported once
])
def test_request_stops_merge_with_default_stops(http: httpx.Client, stop: list[str],
                                                cut_at: str) -> None:
    answer = script("cities").answer
    expected = answer[: answer.index(cut_at)]
    body = chat(http, "cities", stop=stop)
    assert body["choices"][0]["message"]["content"] == expected
    assert body["choices"][0]["matched_stop"] == cut_at

    anthropic = http.post("/v1/messages", json={**anthropic_cities(),
                                                "stop_sequences": stop}).json()
    assert anthropic["content"][0]["text"] == expected, anthropic
    assert anthropic["stop_sequence"] == cut_at

    # Streamed, the same cut: the held-back stop prefix never leaks.
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json={
            "model": DEFAULTS.model, "messages": script("cities").message_dicts,
            "temperature": 0, "max_tokens": 300, "stream": True, "stop": stop}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(line)
    deltas = [json.loads(c[len("data: "):])["choices"] for c in chunks]
    text = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert text == expected


def test_default_stops_never_fire_inside_reasoning(http: httpx.Client) -> None:
    s = script("riddle-think")
    assert s.reasoning is not None and "Check:" in s.reasoning and "Check:" not in s.answer
    body = chat(http, "riddle-think", thinking_budget=200)  # the whole reasoning
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == s.reasoning
    assert choice["message"]["content"] == s.answer
    assert choice["matched_stop"] is None
