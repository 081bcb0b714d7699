"""Cache-aware routing over two replicas (`deployments.prefix_router`): with routing on,
each of several multi-turn conversations stays on one replica and reuses its cached prefix
from turn 2 on; with routing off (Ray's power-of-two choice) turns wander between replicas.

A private local Ray cluster in this process (`ray.init(address="local")`, as the
reliability suite does), so the test can ask each replica for its engine stats: which
replica's `submitted` count grew says where a request went.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from replicas.builtin import ensure_builtin
from tests.serve_process import free_port

pytestmark = pytest.mark.cluster
STICKY, SPREAD = "orchard-sticky", "orchard-spread"
CONVERSATIONS, TURNS = 8, 4
SYSTEM = "You are a careful assistant. Answer briefly and stay on topic. " * 12


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    ensure_builtin("tiny")
    port = free_port()
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        models = [{"id": model, "source": "builtin:tiny", "num_replicas": 2,
                   "max_model_len": 4096, "routing": {"policy": policy}}
                  for model, policy in ((STICKY, "auto"), (SPREAD, "none"))]
        serve.run(build_app({"models": models}), name="orchard", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def submitted(model: str, timeout_s: float = 60) -> dict[str, int]:
    """Requests each replica of `model` has taken, keyed by replica (polled until both
    replicas answered: a handle picks one per call)."""
    handle = serve.get_deployment_handle(f"model:{model}", app_name="orchard")
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only {len(seen)} replicas answered"
        stats: dict[str, Any] = handle.stats.remote().result(timeout_s=timeout_s)
        seen[stats["replica"]] = stats["submitted"]
    return seen


Turns = dict[int, list[int]]


def converse(base_url: str, model: str) -> tuple[dict[int, list[str]], Turns, Turns]:
    """Conversations in lockstep, one request at a time: the replica, the cached prompt
    tokens and the prompt tokens of every turn, per conversation."""
    history = {c: [{"role": "system", "content": SYSTEM}] for c in range(CONVERSATIONS)}
    where: dict[int, list[str]] = {c: [] for c in range(CONVERSATIONS)}
    cached: Turns = {c: [] for c in range(CONVERSATIONS)}
    prompt: Turns = {c: [] for c in range(CONVERSATIONS)}
    with httpx.Client(timeout=120) as client:
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                history[c].append({"role": "user",
                                   "content": f"Conversation {c}, question {turn}: name a city."})
                before = submitted(model)
                r = client.post(f"{base_url}/v1/chat/completions", json={
                    "model": model, "messages": history[c], "temperature": 0, "max_tokens": 8})
                assert r.status_code == 200, r.text
                body = r.json()
                after = submitted(model)
                grew = [name for name in after if after[name] > before.get(name, 0)]
                assert len(grew) == 1, (before, after)
                where[c].append(grew[0])
                cached[c].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                prompt[c].append(body["usage"]["prompt_tokens"])
                history[c].append({"role": "assistant",
                                   "content": body["choices"][0]["message"]["content"]})
    return where, cached, prompt


def test_routing_keeps_each_conversation_on_its_replica(base_url: str) -> None:
    where, cached, prompt = converse(base_url, STICKY)
    for c in range(CONVERSATIONS):
        assert len(set(where[c])) == 1, f"conversation {c} moved: {where[c]}"
        # Each turn reuses at least the whole previous prompt: only the replica that served
        # it holds that KV (a shared system prompt alone is far shorter).
        for turn in range(1, TURNS):
            assert cached[c][turn] >= prompt[c][turn - 1], \
                f"conversation {c} turn {turn}: {cached[c]} cached of {prompt[c]}"
    # Staying put is not all going to one replica: new conversations spread over both.
    assert len({where[c][0] for c in range(CONVERSATIONS)}) == 2, where


def test_without_routing_turns_move_between_replicas(base_url: str) -> None:
    where, _, _ = converse(base_url, SPREAD)
    moves = sum(a != b for c in range(CONVERSATIONS) for a, b in zip(where[c], where[c][1:]))
    # Each of the 24 later turns picks either idle replica at random: all 24 staying put
    # has odds of 1 in 16 million.
    assert moves > 0, where


def test_a_session_key_keeps_unrelated_prompts_together(base_url: str) -> None:
    replicas = []
    with httpx.Client(timeout=120) as client:
        for i in range(6):
            before = submitted(STICKY)
            r = client.post(f"{base_url}/v1/chat/completions", json={
                "model": STICKY, "temperature": 0, "max_tokens": 4,
                "prompt_cache_key": "session-42",
                "messages": [{"role": "user", "content": f"Unrelated prompt number {i}."}]})
            assert r.status_code == 200, r.text
            after = submitted(STICKY)
            replicas += [name for name in after if after[name] > before.get(name, 0)]
    assert len(replicas) == 6 and len(set(replicas)) == 1, replicas
