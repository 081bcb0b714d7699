"""`serve run serve_config.yaml` + the official openai SDK over loopback HTTP."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from replicas.builtin import script
from replicas.options import ReplicaOptions

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
# stream_flush_ms as the servers here run it: the default.
FLUSH_S = ReplicaOptions.__dataclass_fields__["flush_interval_s"].default


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_args(sid: str, **extra: Any) -> dict[str, Any]:
    s = script(sid)
    args: dict[str, Any] = {"model": MODEL, "messages": s.message_dicts, "temperature": 0, "max_tokens": 400}
    if s.enable_thinking is not None:
        args["extra_body"] = {"chat_template_kwargs": {"enable_thinking": s.enable_thinking}}
    args.update(extra)
    return args


def stream_chat(client: openai.OpenAI, **args: Any) -> tuple[str, str, Any]:
    content, reasoning, final = [], [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        if chunk.choices[0].finish_reason is not None:
            final = chunk.choices[0]
    return "".join(content), "".join(reasoning), final


@pytest.mark.parametrize("sid", ["cities", "unicode", "feathers-think", "riddle-nothink"])
def test_chat_streaming_equals_non_streaming(client: openai.OpenAI, sid: str) -> None:
    check_chat_script(client, sid)


def check_chat_script(client: openai.OpenAI, sid: str) -> None:
    """The script's answer and reasoning, exactly, streamed and not, ending with `stop`."""
    full = client.chat.completions.create(**chat_args(sid))
    content, reasoning, final = stream_chat(client, **chat_args(sid))
    message = full.choices[0].message
    assert message.content == content == script(sid).answer
    assert (getattr(message, "reasoning_content", None) or "") == reasoning == (script(sid).reasoning or "")
    assert full.choices[0].finish_reason == final.finish_reason == "stop"


def test_completions_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    s = script("count-completion")
    full = client.completions.create(model=MODEL, prompt=s.prompt, temperature=0, max_tokens=100)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=s.prompt, temperature=0, max_tokens=100, stream=True) if c.choices)
    assert full.choices[0].text == streamed == s.answer
    assert full.usage is not None and full.usage.completion_tokens > 0


def test_sse_arrives_token_by_token_with_usage_and_done(server: str) -> None:
    body = {**{k: v for k, v in chat_args("ocean-prose").items() if k != "extra_body"},
            "stream": True, "stream_options": {"include_usage": True}}
    frames: list[tuple[float, str]] = []  # arrival time, data
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append((time.monotonic(), line[len("data: "):]))
    assert frames[-1][1] == "[DONE]"
    chunks = [(at, json.loads(f)) for at, f in frames[:-1]]
    content = [(at, c["choices"][0]["delta"]["content"]) for at, c in chunks
               if c["choices"] and c["choices"][0]["delta"].get("content")]
    answer = script("ocean-prose").answer
    assert "".join(text for _, text in content) == answer
    # Many deltas, not one blob at the end: the first leaves at once, holding the answer's
    # start only, and later ones at most every 20 ms (the replica's `stream_flush_ms`). How
    # many the answer takes depends on the machine's speed, so the count is checked against
    # the time the deltas spanned: a coarser flush (or none) would give fewer.
    assert len(content) >= 2 and len(content[0][1]) < len(answer)
    spanned = content[-1][0] - content[0][0]
    assert len(content) >= 1 + int(spanned / (2 * FLUSH_S)), (len(content), spanned)
    end = chunks[-1][1]
    assert end["choices"] == [] and end["usage"]["completion_tokens"] > 0


def _stop_cases() -> list[tuple[str, list[str]]]:
    return [
        ("cities", ["3."]),  # period inside a list marker
        ("cities", ["Delhi"]),  # a word
        ("cities", ["\n"]),  # newline
        ("two-paragraphs", ["\n\n"]),  # double newline
        ("ocean-prose", ["."]),  # period
        ("unicode", ["你好"]),  # unicode
        ("markup", ["**"]),
        ("markup", ["</li>"]),
        ("markup", ["```"]),  # code fence
        ("planets", ["4. Mars", "Jupiter", "zzz", "\n5"]),  # four at once
        ("hello", ["How can I help"]),  # multi-token phrase
    ]


@pytest.mark.parametrize(("sid", "stops"), _stop_cases())
def test_stop_strings_truncate_identically_streaming_and_not(
    client: openai.OpenAI, sid: str, stops: list[str]
) -> None:
    full_text = script(sid).answer
    hits = [(full_text.index(s) + len(s), i, s) for i, s in enumerate(stops) if s in full_text]
    _, _, winner = min(hits)  # the earliest-completing stop
    expected = full_text[: full_text.index(winner)]
    body = client.chat.completions.create(**chat_args(sid, stop=stops))
    content, _, final = stream_chat(client, **chat_args(sid, stop=stops))
    choice = body.choices[0]
    assert choice.message.content == content == expected
    assert choice.finish_reason == final.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == final.model_extra["matched_stop"] == winner
    assert choice.model_extra["stop_reason"] == winner


def test_multi_token_stop_really_spans_tokens() -> None:
    from transformers import AutoTokenizer

    from replicas.builtin import ensure_builtin

    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny")))
    assert len(tok.encode("How can I help", add_special_tokens=False)) > 1


def test_stop_that_never_occurs_gives_full_output(client: openai.OpenAI) -> None:
    body = client.chat.completions.create(**chat_args("cities", stop=["never-in-output"]))
    assert body.choices[0].message.content == script("cities").answer
    assert body.choices[0].model_extra["matched_stop"] is None


def test_length_finish(client: openai.OpenAI) -> None:
    body = client.chat.completions.create(**chat_args("cities", max_tokens=4))
    assert body.choices[0].finish_reason == "length"
    assert body.usage.completion_tokens == 4


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ("{not json", 400, None),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: str, client: openai.OpenAI, payload: Any, status: int, param: str | None
) -> None:
    content = payload if isinstance(payload, str) else json.dumps(payload)
    r = httpx.post(f"{server}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert param in (error.get("param") or error["message"])
    ok = client.chat.completions.create(**chat_args("hello"))
    assert ok.choices[0].message.content == script("hello").answer


def test_unknown_model_raises_sdk_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert MODEL in str(info.value)


def test_a_body_past_grpcs_default_message_size_gets_the_apis_error(
        server: str, client: openai.OpenAI) -> None:
    # 6 MiB of prompt: past gRPC's 4 MiB default message size, which Serve's replicas keep
    # where Serve's proxy reaches them over gRPC (deployments/serve_options.py), but within
    # the edge's 32 MiB: every layout answers the context-length error, not an internal one.
    text = "hello " * (6 * 1024 * 1024 // 6)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": text}])
    assert info.value.status_code == 400
    assert "context length" in str(info.value)
    ok = client.chat.completions.create(**chat_args("hello"))
    assert ok.choices[0].message.content == script("hello").answer
