"""Streams outlive their replica (issue 32): kill -9 the replica process serving them
mid-answer, and every request, in all three APIs, streamed and not, completes with exactly
the text an uninterrupted run gives, through the official SDKs. With two replicas the
streams go on on the other one; with one, on the replacement Serve starts.

The requests share one session key, so the two-replica model's router puts them all on one
replica, the one killed. A stream whose replica cannot be replaced within the resume
limits ends with the protocol's error: `test_replica_death.py`, on an app that does not
resume."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anthropic
import openai
import pytest

from replicas.builtin import script
from tests.reliability.cluster import (
    API_KEY,
    PAIR,
    RESUME_PREFIX,
    RESUME_TIMEOUT_S,
    SINGLE,
    Pool,
    all_engine_stats,
    wait_idle,
)
from tests.reliability.test_replica_death import ongoing, replaced
from tests.reliability.wire import eos_id, never_end_bias

pytestmark = pytest.mark.reliability

SESSION = "resume-session"
LONG = 600  # tokens an endless request runs to: long past the kill on any box
WEATHER = {"type": "function", "function": {
    "name": "note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"], "additionalProperties": False}}}


@dataclass
class Outcome:
    """What a client got: the texts it saw, in order of kind, and how it ended."""

    texts: dict[str, str] = field(default_factory=dict)
    end: str | None = None
    output_tokens: int | None = None
    ended_at: float = 0.0

    def add(self, kind: str, text: str | None) -> None:
        if text:
            self.texts[kind] = self.texts.get(kind, "") + text


Run = Callable[[asyncio.Event], Awaitable[Outcome]]


def clients(base: str) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    return (openai.AsyncOpenAI(base_url=f"{base}{RESUME_PREFIX}/v1", api_key=API_KEY,
                               timeout=RESUME_TIMEOUT_S, max_retries=0),
            anthropic.AsyncAnthropic(base_url=f"{base}{RESUME_PREFIX}", api_key=API_KEY,
                                     timeout=RESUME_TIMEOUT_S, max_retries=0))


def cases(oa: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic, model: str) -> dict[str, Run]:
    hello = script("hello").message_dicts
    feathers = script("feathers-think")
    endless = {str(eos_id()): -100}

    async def chat_stream(started: asyncio.Event, **kw: Any) -> Outcome:
        out = Outcome()
        stream = await oa.chat.completions.create(model=model, stream=True, temperature=0,
                                                  prompt_cache_key=SESSION, **kw)
        async for chunk in stream:
            for choice in chunk.choices:
                started.set()
                delta = choice.delta
                out.add("answer", delta.content)
                out.add("reasoning", (delta.model_extra or {}).get("reasoning_content"))
                for call in delta.tool_calls or ():
                    out.add(f"call {call.index} name", call.function.name)
                    out.add(f"call {call.index} arguments", call.function.arguments)
                out.end = choice.finish_reason or out.end
        out.ended_at = time.monotonic()
        return out

    async def chat_whole(started: asyncio.Event) -> Outcome:
        started.set()  # nothing to see before the end
        r = await oa.chat.completions.create(model=model, messages=hello, temperature=0,
                                             max_tokens=LONG, logit_bias=endless,
                                             prompt_cache_key=SESSION)
        out = Outcome(end=r.choices[0].finish_reason, output_tokens=r.usage.completion_tokens)
        out.add("answer", r.choices[0].message.content)
        out.ended_at = time.monotonic()
        return out

    async def completion_stream(started: asyncio.Event) -> Outcome:
        out = Outcome()
        stream = await oa.completions.create(
            model=model, prompt=script("count-completion").prompt or "", max_tokens=LONG,
            temperature=0, logit_bias=never_end_bias(), stream=True,
            extra_body={"prompt_cache_key": SESSION})
        async for chunk in stream:
            started.set()
            out.add("answer", chunk.choices[0].text)
            out.end = chunk.choices[0].finish_reason or out.end
        out.ended_at = time.monotonic()
        return out

    async def messages(started: asyncio.Event, stream: bool) -> Outcome:
        body: dict[str, Any] = dict(
            model=model, max_tokens=2000, messages=feathers.message_dicts,
            thinking={"type": "enabled", "budget_tokens": 1000},
            # In the answer only: pending while the model still reasons.
            stop_sequences=[feathers.answer.split()[3]],
            metadata={"user_id": SESSION}, extra_body={"temperature": 0})
        out = Outcome()
        if stream:
            async with an.messages.stream(**body) as s:
                async for event in s:
                    if event.type == "content_block_delta":
                        started.set()
                message = await s.get_final_message()
        else:
            started.set()
            message = await an.messages.create(**body)
        for block in message.content:
            out.add(block.type, getattr(block, "text", None) or getattr(block, "thinking", None))
        out.end, out.output_tokens = message.stop_reason, message.usage.output_tokens
        out.ended_at = time.monotonic()
        return out

    async def responses(started: asyncio.Event, stream: bool) -> Outcome:
        body: dict[str, Any] = dict(model=model, input=feathers.message_dicts,
                                    max_output_tokens=2000, temperature=0,
                                    reasoning={"effort": "low"}, store=False,
                                    prompt_cache_key=SESSION)
        if stream:
            events = await oa.responses.create(stream=True, **body)
            final = None
            async for event in events:
                if event.type == "response.output_text.delta":
                    started.set()
                if event.type == "response.completed":
                    final = event.response
            assert final is not None
        else:
            started.set()
            final = await oa.responses.create(**body)
        out = Outcome(end=final.status, output_tokens=final.usage.output_tokens
                      if final.usage else None)
        out.add("answer", final.output_text)
        out.ended_at = time.monotonic()
        return out

    return {
        "chat, streamed": lambda s: chat_stream(s, messages=hello, max_tokens=LONG,
                                                logit_bias=endless),
        "chat": chat_whole,
        "completions, streamed": completion_stream,
        # Constrained arguments: the tool's grammar holds while the call runs on.
        "tool call, streamed": lambda s: chat_stream(
            s, messages=hello, max_tokens=LONG // 2, logit_bias=endless, tools=[WEATHER],
            tool_choice="required"),
        "messages, streamed": lambda s: messages(s, True),
        "messages": lambda s: messages(s, False),
        "responses, streamed": lambda s: responses(s, True),
        "responses": lambda s: responses(s, False),
    }


async def pids(pool: Pool) -> dict[str, int]:
    return {name: stats["pid"] for name, stats in (await all_engine_stats(pool)).items()}


async def run_and_kill(base: str, pool: Pool, names: list[str] | None = None) -> None:
    oa, an = clients(base)
    runs = cases(oa, an, pool.model)
    names = names or list(runs)
    reference = await asyncio.gather(*(runs[n](asyncio.Event()) for n in names))
    await wait_idle(pool)
    by_replica = await pids(pool)
    started = {n: asyncio.Event() for n in names}
    calls = [asyncio.create_task(runs[n](started[n])) for n in names]
    deadline = time.monotonic() + 60
    seen: dict[str, int] = {}
    # Every request running and the first stream under way: then kill at once, so the
    # short scripted ones (a few hundred tokens) are cut too. One that has not sent a byte
    # yet starts again on another replica; the rest resume where they were.
    while not (sum(seen.values()) == len(names) and started[names[0]].is_set()):
        seen = {name: await ongoing(name) for name in by_replica}
        assert time.monotonic() < deadline, f"the requests never all ran: {seen}"
        assert not any(c.done() for c in calls), \
            (seen, [n for n, c in zip(names, calls) if c.done()])
    victim = max(seen, key=lambda name: seen[name])
    # The session key holds them together (completions have none, so it may be elsewhere).
    assert seen[victim] >= min(4, len(names)), seen
    os.kill(by_replica[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    outcomes = await asyncio.gather(*calls)
    for name, got, want in zip(names, outcomes, reference):
        # Cut by the kill (none had ended), then whole: the uninterrupted text, byte for byte.
        assert got.ended_at > killed_at, name
        assert (got.texts, got.end, got.output_tokens) == \
            (want.texts, want.end, want.output_tokens), name
    await replaced(pool, victim)


def test_streams_on_a_killed_replica_go_on_on_the_other(cluster: str) -> None:
    asyncio.run(run_and_kill(cluster, PAIR))


def test_a_stream_on_the_only_replica_goes_on_on_the_replacement(cluster: str) -> None:
    asyncio.run(run_and_kill(cluster, SINGLE, ["chat, streamed", "messages, streamed"]))
