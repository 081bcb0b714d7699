"""Colocated serving refuses past its admission limit at once, in each protocol's shape,
and takes requests again once room is back (disconnects: test_disconnect.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.reliability.cluster import (
    COLO,
    auth_headers,
    kill_replica,
    replica_actors,
    wait_idle,
)
from tests.reliability.wire import anthropic_message, openai_chat, running_stream, send

pytestmark = pytest.mark.reliability


def test_a_full_colocated_replica_refuses_at_once_then_admits_again(cluster: str) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=cluster + COLO.prefix, headers=auth_headers(),
                                     timeout=60) as http:
            await wait_idle(COLO)
            runner = openai_chat(COLO.model, stream=True, max_tokens=300, endless=True)
            # The one admitted generation is running.
            async with running_stream(http, "/v1/chat/completions", runner) as (running, lines):
                start = time.monotonic()
                refused = await asyncio.gather(
                    send(http, "/v1/chat/completions", openai_chat(COLO.model, stream=True)),
                    send(http, "/v1/chat/completions", openai_chat(COLO.model, stream=False)),
                    send(http, "/v1/messages", anthropic_message(COLO.model, stream=True)),
                )
                seconds = time.monotonic() - start
                tail = [line async for line in lines]
                runner_ended = time.monotonic()
            assert running.status_code == 200 and "data: [DONE]" in tail  # it finished normally
            for reply in refused:  # refused at once, not queued behind the runner (which
                # would answer only after it ended): no fixed second count to flake on
                assert reply.ended_at < runner_ended, (seconds, reply)
            for reply in refused:
                assert reply.status == (529 if reply.path == "/v1/messages" else 503), reply
                assert reply.headers.get("retry-after"), reply.headers
                assert not reply.is_stream  # refused before any SSE byte
                assert reply.error is not None and reply.error["type"] == "overloaded_error"
            await wait_idle(COLO)
            again = await send(http, "/v1/chat/completions", openai_chat(COLO.model, stream=False))
            assert again.status == 200 and again.error is None, again

    asyncio.run(scenario())


def test_a_killed_colocated_replica_cuts_its_stream_and_a_replacement_serves(
        cluster: str) -> None:
    """What the default layout gives up: the dying process is the HTTP server, so its open
    stream ends without the protocol's error event (the two-hop layout's ingress sends one:
    test_replica_death.py). Requests sent meanwhile wait in Serve's proxy and are served by
    the replacement."""
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=cluster + COLO.prefix, headers=auth_headers(),
                                     timeout=180) as http:
            await wait_idle(COLO)
            [victim] = replica_actors(COLO)
            runner = openai_chat(COLO.model, stream=True, max_tokens=300, endless=True)
            async with running_stream(http, "/v1/chat/completions", runner) as (_, lines):
                kill_replica(victim)
                try:
                    tail = [line async for line in lines]
                except httpx.HTTPError as exc:  # the connection itself may drop
                    tail = [repr(exc)]
            # Seen here: "peer closed connection without sending complete message body".
            assert "data: [DONE]" not in tail, tail[-3:]
            waiting = await send(http, "/v1/chat/completions",
                                 openai_chat(COLO.model, stream=False))
            assert waiting.status == 200 and waiting.error is None, waiting
            assert replica_actors(COLO) not in ([], [victim])

    asyncio.run(scenario())
