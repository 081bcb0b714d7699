"""The Anthropic Messages adapter over raw HTTP, shared by its contract tests: a scripted
app, request bodies, and SSE frames folded into a message the way Anthropic's SDKs do."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from ingress.anthropic import anthropic_validation_message, router
from replicas.contract import Channel, Finished, FinishReason, TextDelta, Usage
from tests.fakes import FakeClient, Script, app_for

MODEL = "orchard-tiny"
USAGE = Usage(prompt_tokens=11, completion_tokens=7)
USAGE_BODY = {
    "input_tokens": 11,
    "output_tokens": 7,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}
USER = [{"role": "user", "content": "Hi"}]


def think(text: str) -> TextDelta:
    return TextDelta(Channel.REASONING, text)


def say(text: str) -> TextDelta:
    return TextDelta(Channel.ANSWER, text)


def done(reason: FinishReason = FinishReason.EOS, stop: str | int | None = None) -> Finished:
    return Finished(reason, USAGE, stop)


EMPTY_ANSWER = (done(),)


def http(script: Script = EMPTY_ANSWER, **options: Any) -> tuple[TestClient, FakeClient]:
    fake = FakeClient(script, **options)
    return TestClient(app_for(router, fake, anthropic_validation_message)), fake


def body(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32, "messages": USER} | overrides


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    frames = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        frames.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return frames


def fold(frames: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """A streamed message accumulated the way Anthropic's SDKs do."""
    message: dict[str, Any] = {}
    partial_json: dict[int, str] = {}
    for name, data in frames:
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(data["content_block"])
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial_json[data["index"]] = partial_json.get(data["index"], "") + delta[
                    "partial_json"
                ]
                continue
            field = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if field is None:
                block["signature"] = delta["signature"]
            else:
                block[field] += delta[field]
        elif name == "content_block_stop" and data["index"] in partial_json:
            try:
                tool_input = json.loads(partial_json[data["index"]])
            except json.JSONDecodeError:
                tool_input = {}  # a call cut short: the renderer sends {} for input that does not parse
            message["content"][data["index"]]["input"] = tool_input
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    return message
