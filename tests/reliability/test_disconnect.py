"""A client that leaves cancels its generation, in both APIs, streaming or not, and a
request that leaves while queued never reaches the engine. Observed on the engine itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import httpx
import pytest

from tests.reliability.cluster import (
    COLO,
    ENDLESS_TOKENS,
    SOLO,
    TIGHT,
    Pool,
    auth_headers,
    engine_stats,
    wait_idle,
)
from tests.reliability.wire import anthropic_long, openai_chat, path_for, running_stream

pytestmark = pytest.mark.reliability


def client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, headers=auth_headers(), timeout=60)


def long_body(protocol: str, model: str, *, stream: bool) -> dict[str, Any]:
    if protocol == "anthropic":
        return anthropic_long(model, stream=stream)
    return openai_chat(model, stream=stream, max_tokens=ENDLESS_TOKENS, endless=True)


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not await condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def cancelled_since(pool: Pool, before: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds until the engine removed one more request on a cancel, and its stats then."""
    latest: dict[str, Any] = {}

    async def removed() -> bool:
        latest.update(await engine_stats(pool.model, pool.app))
        grew = len(latest["cancel_latency_steps"]) > len(before["cancel_latency_steps"])
        return grew and latest["active"] == 0

    # A generous deadline: the feature is judged by decode steps below, not by seconds.
    return await until(removed, 60, "the engine to drop the cancelled request"), latest


def assert_cancelled_promptly(before: dict[str, Any], after: dict[str, Any],
                              seconds: float) -> None:
    assert after["cancel_latency_steps"][-1] <= 1, after  # freed within one decode step
    assert after["finished"] == before["finished"], "the generation ran to its end instead"
    del seconds  # bounded by cancelled_since's deadline; steps are what a 2-core box keeps


# The colocated app serves HTTP from the model replica itself; it must cancel the same way.
@pytest.mark.parametrize("pool", [SOLO, COLO], ids=["ingress", "colocated"])
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_streaming_disconnect_stops_generation(cluster: str, protocol: str, pool: Pool) -> None:
    async def scenario() -> None:
        async with client(cluster + pool.prefix) as http:
            before = await engine_stats(pool.model, pool.app)
            body = long_body(protocol, pool.model, stream=True)
            async with http.stream("POST", path_for(protocol), json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if "delta" in line:
                        break  # generation is under way: leave mid-stream
            seconds, after = await cancelled_since(pool, before)
            assert_cancelled_promptly(before, after, seconds)

    asyncio.run(scenario())


@pytest.mark.parametrize("pool", [SOLO, COLO], ids=["ingress", "colocated"])
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_non_streaming_disconnect_stops_generation(cluster: str, protocol: str, pool: Pool) -> None:
    async def scenario() -> None:
        async with client(cluster + pool.prefix) as http:
            before = await engine_stats(pool.model, pool.app)
            body = long_body(protocol, pool.model, stream=False)
            request = asyncio.create_task(http.post(path_for(protocol), json=body))

            async def running() -> bool:
                return bool((await engine_stats(pool.model, pool.app))["active"])

            await until(running, 60, "the generation to start")
            request.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await request
            seconds, after = await cancelled_since(pool, before)
            assert_cancelled_promptly(before, after, seconds)

    asyncio.run(scenario())


@pytest.mark.parametrize(("protocol", "stream"), [("openai", True), ("openai", False),
                                                  ("anthropic", True), ("anthropic", False)])
def test_request_that_leaves_while_queued_never_reaches_the_engine(
    cluster: str, protocol: str, stream: bool
) -> None:
    async def scenario() -> None:
        async with client(cluster) as http:
            await wait_idle(TIGHT)
            before = await engine_stats(TIGHT.model)
            # Outlasts the queueing below on a loaded box: a runner that ended would free
            # its slot, and a probe would be served instead of refused.
            runner = openai_chat(TIGHT.model, stream=True, max_tokens=ENDLESS_TOKENS,
                                 endless=True)
            async with running_stream(http, "/v1/chat/completions", runner):
                # The only running slot is taken; the request queues behind it.
                body = long_body(protocol, TIGHT.model, stream=stream)
                queued = await queue_behind_runner(http, path_for(protocol), body)
                queued.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await queued
            # The runner left too. A follow-up queues behind anything still waiting, so once
            # it is answered, a leaked request would have reached the engine before it.
            follow_up = await http.post("/v1/chat/completions",
                                        json=openai_chat(TIGHT.model, stream=False))
            assert follow_up.status_code == 200, follow_up.text
            await wait_idle(TIGHT)
            after = await engine_stats(TIGHT.model)
        # Decoding a token needs a batch slot. The runner and the follow-up took one each;
        # the cancelled request took none, so it decoded nothing: it was neither finished
        # nor removed from the batch (only the runner's cancel was).
        assert after["replica"] == before["replica"]  # TIGHT has one replica
        assert after["submitted"] == before["submitted"] + 2, (before, after)
        assert after["finished"] == before["finished"] + 1, (before, after)
        assert len(after["cancel_latency_steps"]) == len(before["cancel_latency_steps"]) + 1

    asyncio.run(scenario())


async def queue_behind_runner(http: httpx.AsyncClient, path: str,
                              body: dict[str, Any]) -> asyncio.Task[httpx.Response]:
    """A request that is waiting in the handle's one queue slot, shown by a probe's 503.

    Polls instead of sleeping a fixed time: on a slow box the request can take a while to
    reach the queue. A probe that is not refused at once took the free slot itself; it is
    dropped and the request sent again (it may have been refused meanwhile). A queue that
    never fills fails the test at the deadline."""
    probe_body = openai_chat(TIGHT.model, stream=False, max_tokens=1)
    deadline = time.monotonic() + 60
    queued = asyncio.create_task(http.post(path, json=body))
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if queued.done():  # refused while a probe held the slot: queue it again
            assert queued.result().status_code == 503, queued.result().text
            queued = asyncio.create_task(http.post(path, json=body))
            continue
        try:
            probe = await http.post("/v1/chat/completions", json=probe_body, timeout=3.0)
        except httpx.TimeoutException:
            continue  # the probe was queued: the request had not reached the queue yet
        assert probe.status_code == 503, f"the probe got {probe.status_code}: {probe.text}"
        if not queued.done():
            return queued
    queued.cancel()
    raise AssertionError("the request never waited in the queue within 60 s")
