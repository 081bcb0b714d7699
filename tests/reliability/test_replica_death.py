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
# A scenario the box's stall voided before the kill (a request met the 5 s deadline) runs
# again, up to this many times; each waits this long for the pool to be idle.
ATTEMPTS = 3
STALL_PATIENCE_S = 120.0


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
            for _ in range(ATTEMPTS):
                await wait_idle(TINY, timeout_s=STALL_PATIENCE_S)
                replicas = replica_actors(TINY)
                assert len(replicas) == TINY.replicas
                # Each replica runs one request at a time, so the two streams run on both.
                started = [asyncio.Event(), asyncio.Event()]
                streams = [asyncio.create_task(send(http, path_for(protocol),
                                                    stream_body(protocol), event))
                           for event in started]
                if await all_started(started, streams):
                    break
            else:
                raise AssertionError(f"the box stalled past the deadline {ATTEMPTS} times")
            killed_at = time.monotonic()
            kill_replica(replicas[0])
            replies = await asyncio.gather(*streams)

            died = [r for r in replies if not r.completed and not ended_by_deadline(r)]
            assert len(died) == 1, [r.body[-300:] for r in replies]
            [victim] = died
            # The survivor is not touched by the death: it completes, unless CI's loaded box
            # made it outlive the cluster's 5 s deadline (which ends it with a timeout_error).
            [survivor] = [r for r in replies if r is not victim]
            assert survivor.completed or ended_by_deadline(survivor), survivor.body[-300:]
            # Ended by the death itself, in the protocol's shape, not later by the request
            # deadline (a timeout_error): no wall-clock bound, so a slow box cannot flake this.
            assert_died(victim, path_for(protocol), stream=True, model=TINY.model)
            assert victim.ended_at > killed_at

            for _ in range(4):  # the survivor keeps serving new requests
                follow_up = await answered(http, TINY, openai_chat(TINY.model, stream=False))
                assert follow_up.completed, follow_up.body

            await replaced(TINY, replicas[0])

    asyncio.run(scenario())


async def all_started(started: list[asyncio.Event], calls: list[asyncio.Task[Reply]]) -> bool:
    """Whether every stream got its first delta. False (the attempt is void) when one ended
    first: on CI's loaded box a stall once outlasted the cluster's 5 s deadline."""
    waits = [asyncio.ensure_future(event.wait()) for event in started]
    pending = {*waits, *calls}
    while any(not w.done() for w in waits):
        done, pending = await asyncio.wait(pending, timeout=STALL_PATIENCE_S,
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        if any(c in done for c in calls):
            break
    ok = all(w.done() for w in waits) and not any(c.done() for c in calls)
    for w in waits:
        w.cancel()
    if not ok:
        replies = await asyncio.gather(*calls)  # the deadline ends the rest within seconds
        assert all(r.completed or ended_by_deadline(r) for r in replies), \
            [r.body[-300:] for r in replies]
    return ok


async def answered(http: httpx.AsyncClient, pool: Pool, body: dict[str, Any]) -> Reply:
    """A short request's reply, sent again (once the pool is idle) while the box is so slow
    that the 5 s deadline ends it."""
    for _ in range(ATTEMPTS):
        reply = await send(http, "/v1/chat/completions", body)
        if not (reply.status == 504 and reply.error and reply.error["type"] == "timeout_error"):
            return reply
        await wait_idle(pool, timeout_s=STALL_PATIENCE_S)
    return reply


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


def ended_by_deadline(reply: Reply) -> bool:
    """The request deadline ended it (a 504, or the error event ending its stream)."""
    error = reply.error
    return error is not None and error.get("type") == "timeout_error"


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


async def all_running(replica: str, cases: list[tuple[str, bool]],
                      started: dict[tuple[str, bool], asyncio.Event],
                      calls: list[asyncio.Task[Reply]]) -> bool:
    """Whether every request is on the replica and every stream has its first tokens. False
    (the attempt is void) when one ended first, which only the 5 s deadline may do."""
    deadline = time.monotonic() + STALL_PATIENCE_S
    while not (await ongoing(replica) == len(cases)
               and all(started[c].is_set() for c in cases if c[1])):
        if any(c.done() for c in calls) or time.monotonic() > deadline:
            replies = await asyncio.gather(*calls)  # the deadline ends the rest within seconds
            assert all(ended_by_deadline(r) for r in replies if not r.completed), \
                [r.body[-300:] for r in replies]
            return False
        await asyncio.sleep(0.02)
    return True


def test_killed_replica_fails_every_route_in_its_protocols_shape(cluster: str) -> None:
    """One kill of orchard-solo's only replica while it runs a generation of every route,
    streamed and not: each gets its protocol's error."""
    cases = [(path, stream) for path in ROUTES for stream in (True, False)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=cluster, headers=auth_headers(),
                                     timeout=60) as http:
            for _ in range(ATTEMPTS):
                await wait_idle(SOLO, timeout_s=STALL_PATIENCE_S)
                [replica] = replica_actors(SOLO)
                started = {case: asyncio.Event() for case in cases}
                calls = [asyncio.create_task(send_marking_start(
                    http, path, long_body(path, stream), started[(path, stream)]))
                    for path, stream in cases]
                if await all_running(replica, cases, started, calls):
                    break
            else:
                raise AssertionError(f"the box stalled past the deadline {ATTEMPTS} times")
            kill_replica(replica)
            replies = await asyncio.gather(*calls)
            for (path, stream), reply in zip(cases, replies):
                assert_died(reply, path, stream=stream, model=SOLO.model)
            await replaced(SOLO, replica)
            follow_up = await answered(http, SOLO, openai_chat(SOLO.model, stream=False))
            assert follow_up.completed, follow_up.body

    asyncio.run(scenario())
