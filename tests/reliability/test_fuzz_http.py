"""Fuzzing the HTTP edge in-process (the real app, a fake client): whatever the body,
headers or route, the answer is never a 5xx, always in the protocol's shape (a success
body, or every event of a stream, validates as the official SDK's model of it; an error is
the API's error: `shapes.py`), and prompt.

Bodies start from a valid request and are mutated field by field (wrong types, huge or odd
numbers, missing and unknown keys), or are arbitrary JSON, or arbitrary bytes. Examples are
derandomized so CI is repeatable; ORCHARD_FUZZ_EXAMPLES runs more.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingress.app import create_app
from ingress.options import EdgeOptions
from replicas.contract import (
    Channel,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    Usage,
)
from tests.fakes import FakeClient
from tests.reliability.shapes import shape_problem, stream_problem

pytestmark = pytest.mark.reliability

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("ORCHARD_FUZZ_EXAMPLES", "300"))
ANSWER_TIMEOUT_S = 5.0


def _answer(request: GenerationRequest) -> list[OutputEvent]:
    return [TextDelta(Channel.REASONING, "hm"), TextDelta(Channel.ANSWER, "ok"),
            Finished(FinishReason.EOS, Usage(3, 2))]


APP = create_app(FakeClient(_answer), EdgeOptions(api_keys=frozenset({KEY}),
                                                  max_body_bytes=64 * 1024))

MESSAGES = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "orchard-tiny", "messages": MESSAGES, "max_tokens": 5,
                             "stop": ["x"], "stream": True, "temperature": 0.5,
                             "response_format": {"type": "text"}, "logit_bias": {"1": 2},
                             "stream_options": {"include_usage": True}, "seed": 3},
    "/v1/completions": {"model": "orchard-tiny", "prompt": "hi", "max_tokens": 5,
                        "stream": False, "stop": "x", "stop_token_ids": [1]},
    "/v1/messages": {"model": "orchard-tiny", "messages": MESSAGES, "max_tokens": 5,
                     "system": "be brief", "stop_sequences": ["x"], "stream": True,
                     "thinking": {"type": "enabled", "budget_tokens": 2}},
    "/v1/messages/count_tokens": {"model": "orchard-tiny", "messages": MESSAGES},
    "/tokenize": {"model": "orchard-tiny", "prompt": "hi", "add_special_tokens": False},
    "/detokenize": {"model": "orchard-tiny", "tokens": [1, 2]},
    "/v1/responses": {"model": "orchard-tiny", "input": MESSAGES, "max_output_tokens": 5,
                      "instructions": "be brief", "stream": True,
                      "reasoning": {"effort": "low", "summary": "auto"},
                      "text": {"format": {"type": "text"}}, "tool_choice": "auto"},
}

scalars = st.one_of(
    st.none(), st.booleans(), st.text(max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "orchard-tiny", "user", "assistant", "text", "json_schema",
                     "enabled", "\x00", "🍎" * 3, "{", "-1", "1e309"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
message_like = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"])},
    optional={"content": st.one_of(json_values, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "thinking", "image", "tool_use"]),
         "text": json_values}), max_size=3))},
)


@st.composite
def mutated(draw: st.DrawFn, path: str) -> dict[str, Any]:
    body = dict(VALID[path])
    for key in list(body):
        choice = draw(st.integers(0, 5))
        if choice == 0:
            del body[key]
        elif choice == 1:
            body[key] = draw(json_values)
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(message_like, max_size=3))
    body.update(draw(st.dictionaries(st.sampled_from(
        ["n", "top_p", "top_k", "min_p", "guided_choice", "guided_regex", "guided_json",
         "max_completion_tokens", "reasoning_effort", "chat_template_kwargs", "echo",
         "metadata", "tools", "thinking_budget", "repetition_penalty", "logprobs",
         "previous_response_id", "input", "store", "include", "background"]),
        json_values, max_size=3)))
    return body


# What each API cannot do without; every other field of VALID is optional.
REQUIRED = {"/v1/chat/completions": {"model", "messages"}, "/v1/completions": {"model", "prompt"},
            "/v1/messages": {"model", "messages", "max_tokens"},
            "/v1/messages/count_tokens": {"model", "messages"},
            "/tokenize": {"prompt"}, "/detokenize": {"tokens"},
            "/v1/responses": {"model", "input"}}
# Answered at once, never streamed.
UNSTREAMED = {"/v1/messages/count_tokens", "/tokenize", "/detokenize"}


@st.composite
def valid_variant(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A valid body, streamed or not, with each optional field kept or left out: mutated
    bodies are nearly all refused, so these are what put the success shapes to the test."""
    body = {k: v for k, v in VALID[path].items() if k in REQUIRED[path] or draw(st.booleans())}
    if path not in UNSTREAMED:
        body["stream"] = draw(st.booleans())
    if not body.get("stream"):
        body.pop("stream_options", None)  # only a stream takes it
    return body


def _encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


requests = st.one_of(
    st.sampled_from(sorted(VALID)).flatmap(lambda p: st.tuples(
        st.just(p), mutated(p).map(_encode))),
    st.tuples(st.sampled_from(sorted(VALID)), json_values.map(_encode)),
    st.tuples(st.sampled_from(sorted(VALID)), st.binary(max_size=64)),
)
headers = st.one_of(
    st.just({"authorization": f"Bearer {KEY}"}),
    st.just({"x-api-key": KEY}),
    st.dictionaries(st.sampled_from(["authorization", "x-api-key", "content-type"]),
                    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
                    max_size=2),
)


async def _send(method: str, path: str, content: bytes, extra: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
        call = http.request(method, path, content=content,
                            headers={"content-type": "application/json", **extra})
        return await asyncio.wait_for(call, ANSWER_TIMEOUT_S)  # a hang fails the example


def _check(response: httpx.Response, path: str) -> None:
    """Never a 5xx; whatever else, in the API's shape: an error body, a success body, or
    (streamed) every event, ending its normal way."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        assert response.status_code == 200, response.status_code
        problem, _ = stream_problem(path, response.text)
    elif path == "/docs" and response.status_code == 200:
        problem = None if content_type.startswith("text/html") else content_type  # Swagger UI
    else:
        problem = shape_problem(path, response.status_code, response.json())
    assert problem is None, (problem, response.status_code, response.text[:1000])


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests, headers)
def test_post_routes_never_answer_5xx_or_hang(request: tuple[str, bytes],
                                              extra: dict[str, str]) -> None:
    path, content = request
    _check(asyncio.run(_send("POST", path, content, extra)), path)


@pytest.mark.parametrize("path", sorted(VALID))  # each API its share, streamed and not
@settings(max_examples=max(EXAMPLES // 10, 10), derandomize=True, deadline=None)
@given(data=st.data())
def test_valid_bodies_are_answered_in_the_apis_success_shape(path: str,
                                                             data: st.DataObject) -> None:
    body = data.draw(valid_variant(path))
    response = asyncio.run(_send("POST", path, _encode(body), {"x-api-key": KEY}))
    assert response.status_code == 200, (body, response.text[:500])
    _check(response, path)


@settings(max_examples=max(EXAMPLES // 5, 20), derandomize=True, deadline=None)
@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS"]),
       st.sampled_from(["/v1/models", "/health", "/v1/messages", "/v1/chat/completions",
                        "/v1/responses", "/v1/responses/resp_0", "/v1/..%2f",
                        "/" + "a" * 300, "/docs"]),
       st.binary(max_size=32), headers)
def test_any_route_and_method_never_answers_5xx(method: str, path: str, content: bytes,
                                                extra: dict[str, str]) -> None:
    _check(asyncio.run(_send(method, path, content, extra)), path)
