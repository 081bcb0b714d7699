"""Fuzzing every API against the real tiny model: random and adversarial bodies go through
the real tokenizer, chat template, guided decoding and engine (`fuzz_bodies.py` says which).

Every reply is a 2xx in the API's success shape (`shapes.py`: the body, or every SSE event,
validates as the official SDK's model of it; a stream ends its normal way, or with an
error of the client's making) or a 4xx in the API's own error shape; never a 5xx, a hang or
a stream the server's fault ended. Afterwards the replica is idle and a known-good request
on each API still answers correctly. Seeded, so a run is repeatable; the counts per API are
printed. ORCHARD_FUZZ_REAL_BODIES (default 300), ORCHARD_FUZZ_REAL_S (time budget, default
300) and ORCHARD_FUZZ_REAL_SEED change the run.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from typing import Any

import httpx
import pytest

from replicas.builtin import script
from tests.reliability.cluster import COLO, SOLO, Pool, auth_headers, wait_idle
from tests.reliability.fuzz_bodies import (
    CHAT,
    COMPLETIONS,
    COUNT,
    MESSAGES,
    PATHS,
    RESPONSES,
    Body,
    BodyFuzzer,
)
from tests.reliability.shapes import shape_problem, stream_problem

pytestmark = pytest.mark.reliability

BODIES = int(os.environ.get("ORCHARD_FUZZ_REAL_BODIES", "300"))
BUDGET_S = float(os.environ.get("ORCHARD_FUZZ_REAL_S", "300"))
SEED = int(os.environ.get("ORCHARD_FUZZ_REAL_SEED", "19"))
# One at a time: a body that is slow to prepare (an enormous schema, a 200k-character
# prompt) would otherwise push an innocent one past the cluster's 5 s deadline, and a 504
# must name the body that caused it.
CONCURRENCY = 1
ANSWER_TIMEOUT_S = 60.0  # far past the cluster's 5 s request deadline: only a hang hits it
# How long the pool may stay busy after a timed-out body before that counts as a wedge.
STALL_PATIENCE_S = 300.0
MIN_PER_API = 10  # fewer means the run proved nothing about that API

async def _send(http: httpx.AsyncClient, body: Body) -> tuple[int, str, str]:
    async def call() -> tuple[int, str, str]:
        headers = {"content-type": "application/json"}
        async with http.stream("POST", body.path, content=body.content,
                               headers=headers) as response:
            text = "".join([t async for t in response.aiter_text()])
            return response.status_code, response.headers.get("content-type", ""), text

    return await asyncio.wait_for(call(), ANSWER_TIMEOUT_S)


async def _try(http: httpx.AsyncClient, body: Body) -> tuple[str, str | None, str]:
    """(outcome bucket, problem or None, reply text) for one send of `body`."""
    try:
        status, content_type, text = await _send(http, body)
    except (TimeoutError, httpx.HTTPError) as exc:
        return "no-answer", f"{type(exc).__name__}: {exc}", ""
    bucket, problem = _verdict(body, status, content_type, text)
    return bucket, problem, text


def _timed_out(problem: str, text: str) -> bool:
    """The reply is the deadline's (a 504, or an error event of type timeout_error), or
    none came in time."""
    return problem.startswith("TimeoutError") or '"timeout_error"' in text


def _verdict(body: Body, status: int, content_type: str, text: str) -> tuple[str, str | None]:
    """(outcome bucket, problem or None) for one reply."""
    if status >= 500:
        return f"{status}", f"HTTP {status}"
    if content_type.startswith("text/event-stream"):
        problem, client_error = stream_problem(body.path, text)
        return ("200-stream-4xx-error" if client_error else "200-stream"), problem
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return f"{status}", "reply is not JSON"
    return f"{status}", shape_problem(body.path, status, data)


async def _known_good(http: httpx.AsyncClient, model: str) -> None:
    """Each API still answers a scripted request exactly, after the fuzz."""
    hello = script("hello")
    chat = (await http.post(CHAT, json={"model": model, "messages": hello.message_dicts,
                                        "temperature": 0, "max_tokens": 64})).json()
    assert chat["choices"][0]["message"]["content"] == hello.answer, chat
    count = script("count-completion")
    done = (await http.post(COMPLETIONS, json={"model": model, "prompt": count.prompt,
                                               "temperature": 0, "max_tokens": 64})).json()
    assert done["choices"][0]["text"] == count.answer, done
    # Anthropic does not think unless asked: the scripted prompt without thinking.
    plain = script("riddle-nothink")
    message = (await http.post(MESSAGES, json={"model": model, "max_tokens": 64,
                                               "messages": plain.message_dicts,
                                               "temperature": 0})).json()
    assert [b["text"] for b in message["content"] if b["type"] == "text"] == [plain.answer], \
        message
    counted = (await http.post(COUNT, json={"model": model,
                                            "messages": hello.message_dicts})).json()
    assert counted["input_tokens"] > 0, counted
    response = (await http.post(RESPONSES, json={"model": model, "temperature": 0,
                                                 "input": hello.message_dicts,
                                                 "max_output_tokens": 64})).json()
    texts = [part["text"] for item in response["output"] if item["type"] == "message"
             for part in item["content"]]
    assert response["status"] == "completed" and texts == [hello.answer], response


# The multi-model two-hop app, and the default layout (one model on one replica, HTTP served
# from the replica) with a third of the bodies: the same app, over the other client.
@pytest.mark.parametrize(("pool", "bodies"), [(SOLO, BODIES), (COLO, BODIES // 3)],
                         ids=["two-hop", "default"])
def test_every_api_survives_random_and_adversarial_bodies(cluster: str, tmp_path: Any,
                                                          pool: Pool, bodies: int) -> None:
    fuzzer = BodyFuzzer(SEED, pool.model)
    counts: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in PATHS}
    problems: list[dict[str, Any]] = []
    slowest: list[tuple[float, str, str]] = []
    stalled: list[tuple[str, str, bool]] = []  # (path, label, answered when sent again)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=cluster + pool.prefix, headers=auth_headers(),
                                     timeout=ANSWER_TIMEOUT_S) as http:
            await wait_idle(pool)
            await _known_good(http, pool.model)  # the checks themselves hold before the fuzz
            gate = asyncio.Semaphore(CONCURRENCY)
            deadline = time.monotonic() + BUDGET_S

            async def one(body: Body) -> None:
                async with gate:
                    if time.monotonic() > deadline:
                        return  # over budget: not sent, not counted
                    sent_at = time.monotonic()
                    bucket, problem, text = await _try(http, body)
                    if problem is not None and _timed_out(problem, text):
                        # CI's loaded box once stalled for over a minute: a body that meets
                        # the deadline is sent again once the pool is idle, and counts as a
                        # problem only if it times out again.
                        await wait_idle(pool, timeout_s=STALL_PATIENCE_S)
                        bucket, problem, text = await _try(http, body)
                        stalled.append((body.path, body.label, problem is None))
                    counts[body.path][bucket] += 1
                    slowest.append((time.monotonic() - sent_at, body.path, body.label))
                    if problem is not None:
                        problems.append({"path": body.path, "label": body.label,
                                         "problem": problem, "reply": text[-2000:],
                                         "body": body.content[:4000].decode("utf-8", "replace")})

            # Round robin, so every API gets its share of the budget.
            await asyncio.gather(*(one(fuzzer.body(PATHS[i % len(PATHS)]))
                                   for i in range(bodies)))
            await wait_idle(pool, timeout_s=60)  # nothing left running or queued
            await _known_good(http, pool.model)

    started = time.monotonic()
    try:
        asyncio.run(scenario())
    finally:
        sent = {p: sum(c.values()) for p, c in counts.items()}
        print(f"\nfuzz against the real model: {sum(sent.values())} bodies in "
              f"{time.monotonic() - started:.0f} s (seed {SEED})")
        for path, counter in counts.items():
            print(f"  {path:<28} {sent[path]:>4}  {dict(sorted(counter.items()))}")
        print("  slowest:", [(round(s, 1), p, label) for s, p, label in sorted(slowest)[-5:]])
        if stalled:
            print("  timed out, then sent again (answered?):", stalled)
    if problems:
        report = tmp_path / "fuzz_problems.json"
        report.write_text(json.dumps(problems, indent=1))
        print(f"  problems written to {report}")
    assert not problems, (f"{len(problems)} bad replies, e.g. "
                          f"{json.dumps(problems[:3], indent=1)[:6000]}")
    assert all(n >= MIN_PER_API for n in sent.values()), f"too few bodies ran: {sent}"
