"""`/v1/messages` over real HTTP with the official anthropic SDK."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from replicas.builtin import script

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
# Without `thinking`, Anthropic means no reasoning: the template gets enable_thinking=False,
# so the scripts that were trained with that prompt are the ones to use.
PLAIN = "riddle-nothink"


@pytest.fixture(scope="module")
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def args(sid: str, **extra: Any) -> dict[str, Any]:
    s = script(sid)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 400,
                            "messages": [m for m in s.message_dicts if m["role"] != "system"],
                            "extra_body": {"temperature": 0}}
    system = [m["content"] for m in s.message_dicts if m["role"] == "system"]
    if system:
        body["system"] = system[0]
    body.update(extra)
    return body


def text_of(message: Any, kind: str = "text") -> str:
    return "".join(getattr(b, kind) for b in message.content if b.type == kind)


def test_streaming_and_non_streaming_agree(client: anthropic.Anthropic) -> None:
    full = client.messages.create(**args(PLAIN))
    with client.messages.stream(**args(PLAIN)) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text_of(full) == streamed == text_of(final) == script(PLAIN).answer
    assert full.stop_reason == final.stop_reason == "end_turn"
    assert full.stop_sequence is None and full.usage.output_tokens > 0


def test_multi_token_stop_sequence_is_reported_and_never_leaks(client: anthropic.Anthropic) -> None:
    from transformers import AutoTokenizer

    from replicas.builtin import ensure_builtin

    stop = "none of them"
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny")))
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    full = client.messages.create(**args(PLAIN, stop_sequences=["zzz", stop]))
    pieces = []
    with client.messages.stream(**args(PLAIN, stop_sequences=["zzz", stop])) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                pieces.append(event.delta.text)
        final = stream.get_final_message()
    expected = script(PLAIN).answer[: script(PLAIN).answer.index(stop)]
    assert text_of(full) == "".join(pieces) == expected
    assert not any(stop[:k] and expected.endswith(stop[:k]) for k in range(1, len(stop)))
    assert full.stop_reason == final.stop_reason == "stop_sequence"
    assert full.stop_sequence == final.stop_sequence == stop


def test_max_tokens(client: anthropic.Anthropic) -> None:
    message = client.messages.create(**args(PLAIN, max_tokens=3))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_thinking_blocks(client: anthropic.Anthropic) -> None:
    thinking = {"type": "enabled", "budget_tokens": 300}
    message = client.messages.create(**args("feathers-think", thinking=thinking))
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert text_of(message, "thinking") == script("feathers-think").reasoning
    assert text_of(message) == script("feathers-think").answer
    with client.messages.stream(**args("feathers-think", thinking=thinking)) as stream:
        final = stream.get_final_message()
    # The stream helper returns Parsed* block classes; compare what they carry.
    assert [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in final.content] == \
        [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in message.content]
    assert final.stop_reason == message.stop_reason == "end_turn"


def test_bad_requests_raise_the_right_sdk_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        client.post("/v1/messages", cast_to=object,
                    body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert text_of(client.messages.create(**args(PLAIN))) == script(PLAIN).answer


def test_count_tokens(client: anthropic.Anthropic) -> None:
    count = client.messages.count_tokens(model=MODEL, messages=script("hello").message_dicts)
    assert count.input_tokens > 5
