"""The shipped layout under faults: the model's replica serves the port itself (Serve's
direct ingress, `serve_config.yaml`), with Serve's proxy one port above it.

A real `serve run` of the shipped config (on a free port, with a Ray of its own), its
replica's process killed with SIGKILL mid-stream: the open stream ends (dropped, never
hung), a request sent through Serve's proxy meanwhile waits for the replacement and is
served, and the replacement takes the replica's port back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.reliability.wire import openai_chat, running_stream, send  # noqa: E402
from tests.serve_process import ServeProcess, listeners, private_serve, stop  # noqa: E402

pytestmark = pytest.mark.reliability

MODEL = "orchard-tiny"
HTTP_REPLICA = f"ServeReplica:orchard:model:{MODEL}"  # Ray's title for the colocated replica
STREAM_END_S = 30.0  # a killed server's stream ends at once; this only bounds a hang
REPLACEMENT_S = 120.0


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with private_serve(tmp_path_factory.mktemp("direct"),
                       [{"id": MODEL, "source": "builtin:tiny", "num_replicas": 1}],
                       ("tiny",)) as serve:
        yield serve


def port_of(serve: ServeProcess) -> int:
    return int(serve.base_url.rsplit(":", 1)[1])


def test_the_replica_holds_the_port_and_serves_proxy_one_above(shipped: ServeProcess) -> None:
    port = port_of(shipped)
    [replica] = listeners(shipped.proc.pid, port)
    assert HTTP_REPLICA in " ".join(replica.cmdline())
    [proxy] = listeners(shipped.proc.pid, port + 1)
    assert "ProxyActor" in " ".join(proxy.cmdline())
    for entrance in (port, port + 1):  # both ways in answer the same model
        models = httpx.get(f"http://127.0.0.1:{entrance}/v1/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_a_killed_replica_ends_its_stream_and_its_replacement_takes_the_port(
        shipped: ServeProcess) -> None:
    """What serving the port from the replica gives up: the dying process is the server, so
    its open stream drops (no error event; the two-hop layout resumes it, test_stream_
    resume.py), and its port refuses until the replacement is up. Serve's proxy, one port
    above, holds a request sent meanwhile until the replacement serves it."""
    port = port_of(shipped)
    [victim] = listeners(shipped.proc.pid, port)
    proxy = f"http://127.0.0.1:{port + 1}"

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=shipped.base_url, timeout=REPLACEMENT_S) as http:
            runner = openai_chat(MODEL, stream=True, max_tokens=2000, endless=True)
            async with running_stream(http, "/v1/chat/completions", runner) as (_, lines):
                os.kill(victim.pid, signal.SIGKILL)
                start = time.monotonic()
                try:
                    tail = await asyncio.wait_for(_drain(lines), STREAM_END_S)
                except httpx.HTTPError as exc:  # the connection itself drops
                    tail = [repr(exc)]
                ended = time.monotonic() - start
            assert "data: [DONE]" not in tail, tail[-3:]
            assert ended < STREAM_END_S
        async with httpx.AsyncClient(base_url=proxy, timeout=REPLACEMENT_S) as via_proxy:
            waiting = await send(via_proxy, "/v1/chat/completions",
                                 openai_chat(MODEL, stream=False))
        assert waiting.status == 200 and waiting.error is None, waiting

    asyncio.run(scenario())
    deadline = time.monotonic() + REPLACEMENT_S
    while not (now := listeners(shipped.proc.pid, port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    [replacement] = now
    assert replacement.pid != victim.pid and HTTP_REPLICA in " ".join(replacement.cmdline())
    again = httpx.post(f"{shipped.base_url}/v1/chat/completions", timeout=60,
                       json=openai_chat(MODEL, stream=False))
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]


def test_serve_run_again_takes_the_port_its_last_run_closed(
        shipped: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A `serve run` stopped while clients held keep-alive connections, as SDKs do, leaves
    the port's side of them in TIME_WAIT for a minute; the next run's replica must bind over
    it, as Serve's proxy binds (`serve_options.bind_like_serves_proxy`). Ray 2.60's own
    direct-ingress bind fails there, and Serve then blocks the port: the app never comes up.

    The module's own run is the one stopped (last in the file, so the tests above ran on
    it first): one `serve run` fewer than starting a first run here."""
    port = port_of(shipped)
    idle = keep_alive(port)
    stop(shipped.proc)  # Ctrl-C, as a person stops it; the fixture's own stop is then a no-op
    assert idle.recv(1) == b""  # the stopped server closed it first
    idle.close()
    assert time_waits(port), "nothing lingers on the port: the test would prove nothing"
    models = [{"id": MODEL, "source": "builtin:tiny", "num_replicas": 1}]
    with private_serve(tmp_path_factory.mktemp("again"), models, ("tiny",), port=port) as again:
        answer = httpx.post(f"{again.base_url}/v1/chat/completions", timeout=60,
                            json=openai_chat(MODEL, stream=False))
        assert answer.status_code == 200


def keep_alive(port: int) -> socket.socket:
    """A client connection that has had its answer and stays open, as SDKs keep them."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        body += sock.recv(65536)
    return sock


def time_waits(port: int) -> int:
    """Sockets in TIME_WAIT whose local port is `port` (Linux's /proc/net/tcp, state 06)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                count += state == "06" and int(local.rsplit(":", 1)[1], 16) == port
    return count


async def _drain(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines]

