"""A replica killed mid-generation (`ray.kill`, the real death path): each of its clients
gets the protocol's own error at once (a 500 in the API's error shape before any byte, or the
API's error event ending an open stream), on every route, streaming and not; the other
replica keeps serving, and Serve starts a replacement."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import ray

from replicas.builtin import script
from tests.reliability.cluster import (
    SOLO,
    TINY,
    Pool,
    auth_headers,
    kill_replica,
    replica_actors,
    wait_idle,
)
from tests.reliability.wire import (
    Reply,
    anthropic_long,
    never_end_bias,
    openai_chat,
    parse_sse,
    path_for,
    send,
)

pytestmark = pytest.mark.reliability

REPLACEMENT_TIMEOUT_S = 120


def stream_body(protocol: str) -> dict[str, Any]:
    if protocol == "anthropic":
        return anthropic_long(TINY.model, stream=True)
    # Long enough to be killed mid-way, short enough for the survivor to finish in time.
    return openai_chat(TINY.model, stream=True, max_tokens=400, endless=True)


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_killed_replica_fails_its_stream_and_the_other_keeps_serving(
    cluster: str, protocol: str
) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=cluster, headers=auth_headers(),
                                     timeout=60) as http:
            await wait_idle(TINY)
            replicas = replica_actors(TINY)
            assert len(replicas) == TINY.replicas
            # Each replica runs one request at a time, so the two streams run on both.
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(send(http, path_for(protocol), stream_body(protocol),
                                                event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
            killed_at = time.monotonic()
            kill_replica(replicas[0])
            replies = await asyncio.gather(*streams)

            failed = [r for r in replies if not r.completed]
            assert len(failed) == 1, [r.body[-300:] for r in replies]
            [victim] = failed
            # Ended by the death itself, in the protocol's shape, not later by the request
            # deadline (a timeout_error): no wall-clock bound, so a slow box cannot flake this.
            assert_died(victim, path_for(protocol), stream=True, model=TINY.model)
            assert victim.ended_at > killed_at

            for _ in range(4):  # the survivor keeps serving new requests
                follow_up = await send(http, "/v1/chat/completions",
                                       openai_chat(TINY.model, stream=False))
                assert follow_up.completed, follow_up.body

            await replaced(TINY, replicas[0])

    asyncio.run(scenario())


async def replaced(pool: Pool, dead: str) -> None:
    """Wait for Serve to replace the killed replica, and for the new one to answer."""
    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while True:
        now = replica_actors(pool)
        if len(now) == pool.replicas and dead not in now:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {now}"
        await asyncio.sleep(0.5)
    await wait_idle(pool, timeout_s=REPLACEMENT_TIMEOUT_S)  # it answers, too


def assert_died(reply: Reply, path: str, *, stream: bool, model: str) -> None:
    """The reply is the protocol's own "the replica failed" error, and nothing else."""
    message = f"the replica serving '{model}' failed"
    tail = reply.body[-600:]
    assert "Traceback" not in reply.body and "RayActorError" not in reply.body, tail
    if not stream:
        assert reply.status == 500 and not reply.is_stream, (reply.status, tail)
        if path == "/v1/messages":
            assert reply.json == {"type": "error",
                                  "error": {"type": "api_error", "message": message}}, tail
        else:  # OpenAI's shape, the Responses API included
            assert reply.json == {"error": {"message": message, "type": "internal_error",
                                            "param": None, "code": "internal"}}, tail
        return
    assert reply.status == 200 and reply.is_stream, (reply.status, tail)
    names = [name for name, _ in reply.events]
    if path == "/v1/messages":
        assert names[0] == "message_start" and "message_stop" not in names, names
        assert reply.events[-1] == ("error", {"type": "error", "error": {
            "type": "api_error", "message": message}}), tail
    elif path == "/v1/responses":
        assert names[0] == "response.created", names
        assert "response.completed" not in names and "response.incomplete" not in names
        name, last = reply.events[-1]
        assert name == "response.failed" and last["type"] == "response.failed", tail
        assert last["response"]["status"] == "failed"
        assert last["response"]["error"] == {"code": "server_error", "message": message}
        numbers = [data["sequence_number"] for _, data in reply.events]
        assert numbers == list(range(len(numbers))), numbers
    else:  # chat and completions: unnamed data frames, no [DONE] after the error
        assert all(name is None for name in names) and "[DONE]" not in reply.body, tail
        assert reply.events[-1] == (None, {"error": {"message": message,
                                                     "type": "internal_error",
                                                     "param": None, "code": "internal"}}), tail


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]


def long_body(path: str, stream: bool) -> dict[str, Any]:
    """A generation that outlives the kill: endless where the API has logit_bias, else the
    longest scripted one (a few hundred decode steps, eight of them sharing the batch)."""
    feathers = script("feathers-think")
    if path == "/v1/chat/completions":
        return openai_chat(SOLO.model, stream=stream, max_tokens=2000, endless=True)
    if path == "/v1/completions":
        return {"model": SOLO.model, "prompt": script("count-completion").prompt,
                "max_tokens": 2000, "temperature": 0, "logit_bias": never_end_bias(),
                "stream": stream}
    if path == "/v1/messages":
        return anthropic_long(SOLO.model, stream=stream)
    return {"model": SOLO.model, "input": feathers.message_dicts, "max_output_tokens": 2000,
            "temperature": 0, "reasoning": {"effort": "low"}, "stream": stream,
            "store": False}


async def ongoing(name: str) -> int:
    """Requests the replica actor holds right now (Serve's own count, answered on a separate
    thread, so it is not queued behind the generations it counts)."""
    actor = ray.get_actor(name, namespace="serve")
    count: int = await actor.get_num_ongoing_requests.remote()
    return count


async def send_marking_start(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                             started: asyncio.Event) -> Reply:
    """`send`, with `started` set at the first body byte: the stream opens only once the
    replica produced its first tokens."""
    chunks: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        async for text in response.aiter_text():
            chunks.append(text)
            started.set()
    reply = Reply(path, response.status_code, dict(response.headers), "".join(chunks),
                  ended_at=time.monotonic())
    if reply.is_stream:
        reply.events = parse_sse(reply.body)
    return reply


def test_killed_replica_fails_every_route_in_its_protocols_shape(cluster: str) -> None:
    """One kill of orchard-solo's only replica while it runs a generation of every route,
    streamed and not: each gets its protocol's error."""
    cases = [(path, stream) for path in ROUTES for stream in (True, False)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=cluster, headers=auth_headers(),
                                     timeout=60) as http:
            await wait_idle(SOLO)
            [replica] = replica_actors(SOLO)
            started = {case: asyncio.Event() for case in cases}
            calls = [asyncio.create_task(send_marking_start(
                http, path, long_body(path, stream), started[(path, stream)]))
                for path, stream in cases]
            # Every request is on the replica, and every stream has its first tokens.
            deadline = time.monotonic() + 30
            while not (await ongoing(replica) == len(cases)
                       and all(started[c].is_set() for c in cases if c[1])):
                assert time.monotonic() < deadline, (await ongoing(replica), started)
                assert not any(c.done() for c in calls), [c.result().body[-300:]
                                                          for c in calls if c.done()]
                await asyncio.sleep(0.02)
            kill_replica(replica)
            replies = await asyncio.gather(*calls)
            for (path, stream), reply in zip(cases, replies):
                assert_died(reply, path, stream=stream, model=SOLO.model)
            await replaced(SOLO, replica)
            follow_up = await send(http, "/v1/chat/completions",
                                   openai_chat(SOLO.model, stream=False))
            assert follow_up.completed, follow_up.body

    asyncio.run(scenario())
