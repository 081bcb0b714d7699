"""Colocated serving refuses past its admission limit at once, in each protocol's shape,
and takes requests again once room is back (disconnects: test_disconnect.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.reliability.cluster import COLO, auth_headers, wait_idle
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
