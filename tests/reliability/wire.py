"""Request bodies and SSE reading for the reliability tests, in both protocols."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import httpx
from transformers import AutoTokenizer

from replicas.builtin import ensure_builtin, script


@cache
def eos_id() -> int:
    """The tiny model's `<|im_end|>`: suppressing it makes a generation run to max_tokens."""
    token_id = AutoTokenizer.from_pretrained(ensure_builtin("tiny")).convert_tokens_to_ids(
        "<|im_end|>")
    assert isinstance(token_id, int)
    return token_id


def never_end_bias() -> dict[str, float]:
    """A logit_bias banning every end-of-text token (`<|im_end|>`, `<|endoftext|>`), so a
    generation runs to max_tokens whatever the prompt (chat or plain completion)."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin("tiny"))
    ids = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]
    return {str(token_id): -100 for token_id in ids}


def openai_chat(model: str, *, stream: bool, max_tokens: int = 64, endless: bool = False,
                sid: str = "hello") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": script(sid).message_dicts,
                            "temperature": 0, "max_tokens": max_tokens, "stream": stream}
    if endless:
        body["logit_bias"] = {str(eos_id()): -100}
    return body


def anthropic_message(model: str, *, stream: bool, max_tokens: int = 64,
                      sid: str = "hello") -> dict[str, Any]:
    return {"model": model, "messages": script(sid).message_dicts, "temperature": 0,
            "max_tokens": max_tokens, "stream": stream}


def anthropic_long(model: str, *, stream: bool) -> dict[str, Any]:
    """The longest scripted answer (reasoning, then text): Anthropic's API has no logit_bias,
    so this is its longest generation, a few hundred decode steps."""
    body = anthropic_message(model, stream=stream, max_tokens=2000, sid="feathers-think")
    body["thinking"] = {"type": "enabled", "budget_tokens": 1000}
    return body


def path_for(protocol: str) -> str:
    return "/v1/messages" if protocol == "anthropic" else "/v1/chat/completions"


@dataclass
class Reply:
    """One HTTP answer, streamed or not, reduced to what the tests check."""

    path: str
    status: int
    headers: dict[str, str]
    body: str
    ended_at: float = 0.0  # time.monotonic() when the last byte arrived
    events: list[tuple[str | None, Any]] = field(default_factory=list)  # (SSE event, data)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    @property
    def is_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> dict[str, Any] | None:
        """The protocol's error: the JSON body's, or the event that ended the stream."""
        if not self.is_stream:
            return self.json.get("error") if self.status != 200 else None
        for name, data in self.events:
            if name == "error" or (name is None and isinstance(data, dict) and "error" in data):
                return data["error"]  # type: ignore[no-any-return]
        return None

    @property
    def completed(self) -> bool:
        """A 200 that ended the protocol's normal way (`[DONE]` or `message_stop`)."""
        if self.status != 200:
            return False
        if not self.is_stream:
            return True
        return any(data == "[DONE]" or name == "message_stop" for name, data in self.events)


def parse_sse(text: str) -> list[tuple[str | None, Any]]:
    events: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                raw = line[len("data: "):]
                data = raw if raw == "[DONE]" else json.loads(raw)
        if data is not None:
            events.append((name, data))
    return events


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any],
               started: asyncio.Event | None = None) -> Reply:
    """POST and read the whole answer, streamed or not; `started` is set at the first delta."""
    chunks: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        async for text in response.aiter_text():
            chunks.append(text)
            if started is not None and "delta" in text:
                started.set()
    reply = Reply(path, response.status_code, dict(response.headers), "".join(chunks),
                  ended_at=time.monotonic())
    if reply.is_stream:
        reply.events = parse_sse(reply.body)
    return reply


@asynccontextmanager
async def running_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[tuple[httpx.Response, AsyncIterator[str]]]:
    """A streamed request, entered once its first delta arrived (it holds a batch slot), and
    held open until the block ends: an abandoned line iterator would hang up early."""
    async with client.stream("POST", path, json=body) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if "delta" in line:
                break
        yield response, lines
