"""A replica killed mid-stream: its client gets an error event at once, the other replica
keeps serving, and Serve starts a replacement."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.reliability.cluster import (
    TINY,
    auth_headers,
    kill_replica,
    replica_actors,
    wait_idle,
)
from tests.reliability.wire import anthropic_long, openai_chat, path_for, send

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
            assert victim.status == 200 and victim.error is not None, victim.body[-300:]
            # Ended by the death itself, not later by the request deadline (which would be a
            # timeout_error): no wall-clock bound, so a slow box cannot flake this.
            assert victim.error["type"] != "timeout_error", victim.error
            assert victim.ended_at > killed_at
            assert "Traceback" not in victim.body

            for _ in range(4):  # the survivor keeps serving new requests
                follow_up = await send(http, "/v1/chat/completions",
                                       openai_chat(TINY.model, stream=False))
                assert follow_up.completed, follow_up.body

            deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
            while True:
                now = replica_actors(TINY)
                if len(now) == TINY.replicas and replicas[0] not in now:
                    break
                assert time.monotonic() < deadline, f"no replacement replica: {now}"
                await asyncio.sleep(0.5)
            await wait_idle(TINY, timeout_s=REPLACEMENT_TIMEOUT_S)  # it answers, too

    asyncio.run(scenario())
