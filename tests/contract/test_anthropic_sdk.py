"""The official `anthropic` SDK as a client of the Messages adapter, in process."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx2
import pytest
from fastapi.testclient import TestClient

from ingress.anthropic import anthropic_validation_message, router
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    Usage,
)
from replicas.errors import ContextLengthError
from tests.fakes import FakeClient, Script, app_for

MODEL = "orchard-tiny"
USAGE = Usage(prompt_tokens=9, completion_tokens=5)
USER: list[Any] = [{"role": "user", "content": "What is 2+2?"}]


def sdk(script: Script, **options: Any) -> anthropic.Anthropic:
    # TestClient is an httpx2.Client, the HTTP client this SDK is built on.
    app = app_for(router, FakeClient(script, **options), anthropic_validation_message)
    return anthropic.Anthropic(
        api_key="test", base_url="http://testserver", http_client=TestClient(app), max_retries=0
    )


def create(client: anthropic.Anthropic, **options: Any) -> anthropic.types.Message:
    return client.messages.create(model=MODEL, max_tokens=64, messages=USER, **options)


SCRIPTS: dict[str, list[OutputEvent]] = {
    "answer": [
        TextDelta(Channel.ANSWER, "Four"),
        TextDelta(Channel.ANSWER, "."),
        Finished(FinishReason.EOS, USAGE),
    ],
    "thinking": [
        TextDelta(Channel.REASONING, "2+2 is "),
        TextDelta(Channel.REASONING, "4."),
        TextDelta(Channel.ANSWER, "Four."),
        Finished(FinishReason.EOS, USAGE),
    ],
    "stop sequence": [
        TextDelta(Channel.ANSWER, "Four"),
        Finished(FinishReason.STOP_SEQUENCE, USAGE, "###"),
    ],
    "max tokens": [TextDelta(Channel.ANSWER, "Fo"), Finished(FinishReason.LENGTH, USAGE)],
    "empty": [Finished(FinishReason.STOP_SEQUENCE, USAGE, "###")],
}


def test_create() -> None:
    message = create(sdk(SCRIPTS["answer"]))
    assert message.id.startswith("msg_") and message.model == MODEL and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "Four."  # type: ignore[union-attr]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 5)


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_stream_helper_final_message_equals_create(script: Script) -> None:
    client = sdk(script)
    whole = create(client)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert text == "".join(block.text for block in whole.content if block.type == "text")


def test_raw_stream_events() -> None:
    client = sdk(SCRIPTS["thinking"])
    events = list(client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True))
    assert [event.type for event in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_thinking_blocks() -> None:
    message = create(sdk(SCRIPTS["thinking"]), thinking={"type": "enabled", "budget_tokens": 32})
    thinking, text = message.content
    assert (
        thinking.type == "thinking"
        and thinking.thinking == "2+2 is 4."
        and thinking.signature == ""
    )
    assert text.type == "text" and text.text == "Four."


def test_stop_sequence_and_max_tokens() -> None:
    stopped = create(sdk(SCRIPTS["stop sequence"]), stop_sequences=["###"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "###")
    assert create(sdk(SCRIPTS["max tokens"])).stop_reason == "max_tokens"


def test_empty_answer_is_accepted() -> None:
    assert create(sdk(SCRIPTS["empty"])).content == []


def test_count_tokens() -> None:
    client = sdk((), input_tokens=17)
    assert client.messages.count_tokens(model=MODEL, messages=USER).input_tokens == 17


@pytest.mark.parametrize(
    "options, error",
    [
        ({"messages": []}, anthropic.BadRequestError),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            # Images are placeholders now; an unknown block is a 400.
                            {"type": "hologram", "source": {}}
                        ],
                    }
                ]
            },
            anthropic.BadRequestError,
        ),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, anthropic.BadRequestError),
        # This SDK no longer offers sampling parameters; older clients still send them.
        ({"extra_body": {"temperature": 3}}, anthropic.BadRequestError),
        ({"model": "claude-opus"}, anthropic.NotFoundError),
    ],
)
def test_bad_requests_raise_sdk_errors(options: dict[str, Any], error: type[Exception]) -> None:
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": USER} | options
    with pytest.raises(error) as raised:
        sdk(SCRIPTS["answer"]).messages.create(**request)
    assert raised.value.body["type"] == "error"  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "first, error",
    [
        (Failed(ErrorKind.OVERLOADED, "busy"), anthropic.OverloadedError),
        (ContextLengthError("prompt too long"), anthropic.BadRequestError),
        (Failed(ErrorKind.INTERNAL, "boom"), anthropic.InternalServerError),
    ],
)
def test_replica_failures_raise_sdk_errors(
    first: Any, error: type[Exception], stream: bool
) -> None:
    with pytest.raises(error):
        create(sdk([first]), stream=stream)


def test_failure_mid_stream_raises_while_iterating() -> None:
    script: list[OutputEvent] = [
        TextDelta(Channel.ANSWER, "Fo"),
        Failed(ErrorKind.INTERNAL, "boom"),
    ]
    with sdk(script).messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        with pytest.raises(anthropic.APIStatusError) as raised:
            stream.get_final_message()
    assert raised.value.body == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def test_async_client_streams_over_asgi() -> None:
    app = app_for(router, FakeClient(SCRIPTS["thinking"]), anthropic_validation_message)

    async def final_message() -> anthropic.types.Message:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = anthropic.AsyncAnthropic(
                api_key="test", base_url="http://testserver", http_client=http, max_retries=0
            )
            async with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
                return await stream.get_final_message()

    message = asyncio.run(final_message())
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.usage.input_tokens == 9
