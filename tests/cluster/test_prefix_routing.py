"""Cache-aware routing over two replicas (`deployments.routing.prefix`): with routing on,
each of several multi-turn conversations stays on one replica and reuses its cached prefix
from turn 2 on; with routing off (Ray's power-of-two choice) turns wander between replicas.
Memory-aware routing (`deployments.routing.headroom`, `orchard-headroom`: a small KV budget): a
turn leaves the replica holding its prefix when that one has no KV room for it, and a
request no replica has room for is shed with the overloaded error and Retry-After, through
the openai SDK.

A private local Ray cluster in this process (`ray.init(address="local")`, as the
reliability suite does), so the test can ask each replica for its engine stats: which
replica's `submitted` count grew says where a request went.
"""

from __future__ import annotations

import random
import time
from typing import Any, Iterator, cast

import httpx
import openai
import pytest
import ray
from ray import serve

from openai import Stream
from openai.types import Completion

from deployments.app import build_app
from deployments.serve_options import controller_options
from ingress.openai.convert import chat_request
from ingress.openai.models import ChatCompletionRequest
from replicas.contract import Finished
from replicas.builtin import ensure_builtin
from tests.reliability.wire import never_end_bias
from tests.serve_process import free_port

pytestmark = pytest.mark.cluster
STICKY, SPREAD, HEADROOM = "orchard-sticky", "orchard-spread", "orchard-headroom"
PULLING, SPLIT = "orchard-pull", "orchard-split"
# orchard-headroom's KV budget in tokens of the tiny model (1024 bytes a token: 2 layers x
# 2 KV heads x head_dim 32 x K and V x float32). It reserves a request's whole max_tokens
# up front, so a blocker (a short prompt, a long output: quick to start, slow to end)
# leaves 1024 tokens of room beside it; a probe's prompt needs more than that.
TINY_KV_BYTES_PER_TOKEN = 1024
BUDGET_TOKENS = 16384
BLOCKER_PROMPT, BLOCKER_OUTPUT = 256, 15000  # reserves 15360 tokens (in 256-token steps)
PROBE_PROMPT = 1536
# A report (every 0.5 s here) taken after a blocker's admission reaches the ingress's
# router through Serve's controller within this long.
STATS_SETTLE_S = 3.0
CONVERSATIONS, TURNS = 8, 4
SYSTEM = "You are a careful assistant. Answer briefly and stay on topic. " * 12


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    ensure_builtin("tiny")
    port = free_port()
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    controller_options=controller_options())
        models = [{"id": model, "source": "builtin:tiny", "num_replicas": 2,
                   "max_model_len": 4096, "routing": {"policy": policy}}
                  for model, policy in ((STICKY, "auto"), (SPREAD, "none"))]
        # A holder one request busier than the other replica loses its preference, so
        # the turn runs elsewhere and pulls the holder's KV.
        models.append({"id": PULLING, "source": "builtin:tiny", "num_replicas": 2,
                       "max_model_len": 4096, "routing": {"max_imbalance": 0,
                                                          "pull": {"min_tokens": 32}}})
        # Prefill and decode roles: long prompts prefilled on one replica, decoded on another.
        models += [{"id": SPLIT, "source": "builtin:tiny", "role": "decode",
                    "max_model_len": 4096, "prefill_min_tokens": 64},
                   {"id": SPLIT, "source": "builtin:tiny", "role": "prefill",
                    "max_model_len": 4096}]
        models.append({"id": HEADROOM, "source": "builtin:tiny", "num_replicas": 2,
                       "routing": {"stats_period_s": 0.5},
                       # No queue for memory: a replica without room would refuse at once,
                       # so the router sheds instead.
                       "memory": {"budget_bytes": BUDGET_TOKENS * TINY_KV_BYTES_PER_TOKEN,
                                  "reservation": "whole", "max_waiting": 0}})
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


def test_a_router_that_never_saw_a_conversation_finds_its_prefix_in_the_directory(
        base_url: str) -> None:
    """The cluster prefix directory: turn 1 of each conversation goes through the
    ingress; turn 2 through a handle made in this process, whose router is its own and
    routed none of them. Only the replicas' reports (their routing stats) can say where
    each prefix lives; with the odds of a coin, all 8 landing right would be 1 in 256."""
    history = {c: [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": f"Directory conversation {c}: name a river."}]
               for c in range(CONVERSATIONS)}
    first: dict[int, str] = {}
    prompt: dict[int, int] = {}
    with httpx.Client(timeout=120) as client:
        for c in range(CONVERSATIONS):
            before = submitted(STICKY)
            r = client.post(f"{base_url}/v1/chat/completions", json={
                "model": STICKY, "messages": history[c], "temperature": 0, "max_tokens": 8})
            assert r.status_code == 200, r.text
            (first[c],) = [n for n, k in submitted(STICKY).items() if k > before.get(n, 0)]
            prompt[c] = r.json()["usage"]["prompt_tokens"]
            history[c] += [{"role": "assistant",
                            "content": r.json()["choices"][0]["message"]["content"]},
                           {"role": "user", "content": "And another one?"}]
    time.sleep(STATS_SETTLE_S)  # the replicas' next reports reach every handle
    handle = serve.get_deployment_handle(f"model:{STICKY}", app_name="orchard")
    for c in range(CONVERSATIONS):
        body = ChatCompletionRequest.model_validate(
            {"model": STICKY, "messages": history[c], "temperature": 0, "max_tokens": 8})
        before = submitted(STICKY)
        events = [e for batch in handle.options(stream=True).stream.remote(
            chat_request(body, STICKY)) for e in batch]
        (went,) = [n for n, k in submitted(STICKY).items() if k > before.get(n, 0)]
        (done,) = [e for e in events if isinstance(e, Finished)]
        assert went == first[c], f"conversation {c}: turn 1 on {first[c]}, turn 2 on {went}"
        assert done.usage.cached_tokens >= prompt[c], (c, done.usage, prompt[c])


def landed_on(model: str, before: dict[str, int]) -> str:
    """The one replica of `model` whose `submitted` count grew past `before`."""
    (grew,) = [n for n, k in submitted(model).items() if k > before.get(n, 0)]
    return grew


def test_a_turn_sent_away_from_its_holder_pulls_the_kv_instead_of_prefilling(
        base_url: str, client: openai.OpenAI) -> None:
    """Pull instead of recompute: turn 1 runs on replica A; a long stream then keeps A
    busier than B, so turn 2 runs on B, which pulls turn 1's KV from A over Ray's object
    store (the router names A in the call). B's pull counters say so, the turn's cached
    tokens cover turn 1, and its text is what a replica computing it afresh writes."""
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "Pull conversation: name a mountain."}]
    before = submitted(PULLING)
    first = client.chat.completions.create(model=PULLING, messages=history,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=8)
    holder = landed_on(PULLING, before)
    assert first.usage is not None
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And another one?"}]
    time.sleep(STATS_SETTLE_S)  # A's report of what it holds reaches the routers
    bias = {str(token): int(value) for token, value in never_end_bias().items()}
    before = submitted(PULLING)
    blocker = client.chat.completions.create(  # the same prefix: it goes to A too
        model=PULLING, messages=[*history[:2], {"role": "user", "content": "Go on forever."}],
        temperature=0, max_tokens=3000, stream=True, logit_bias=bias)  # type: ignore[arg-type]
    try:
        assert next(iter(blocker)) is not None  # decoding on A now
        assert landed_on(PULLING, before) == holder, "the blocker did not go to the holder"
        before = submitted(PULLING)
        turn2 = client.chat.completions.create(model=PULLING, messages=history,  # type: ignore[arg-type]
                                               temperature=0, max_tokens=8)
        went = landed_on(PULLING, before)
    finally:
        blocker.close()
    assert went != holder, "turn 2 stayed on the holder: nothing to pull"
    handle = serve.get_deployment_handle(f"model:{PULLING}", app_name="orchard")
    stats: dict[str, Any] = {}
    while stats.get("replica") != went:  # a handle call lands on either replica
        stats = handle.stats.remote().result(timeout_s=60)
    assert stats["pulls"]["outcomes"] == {"pulled": 1}, stats["pulls"]
    assert turn2.usage is not None and turn2.usage.prompt_tokens_details is not None
    cached = turn2.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= 0.9 * first.usage.prompt_tokens and stats["pulls"]["tokens"] == cached
    fresh = client.chat.completions.create(model=SPREAD, messages=history,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=8)
    assert turn2.choices[0].message.content == fresh.choices[0].message.content


def test_a_long_prompt_is_prefilled_on_the_prefill_replica_and_decoded_on_the_other(
        client: openai.OpenAI) -> None:
    """Prefill and decode roles: a prompt past `prefill_min_tokens` is prefilled by the
    prefill deployment, its KV handed back over Ray's object store, and decoded on the
    decode replica (their counters say which did what); a short prompt stays put. The
    text is what a replica doing both writes."""
    decode = serve.get_deployment_handle(f"model:{SPLIT}", app_name="orchard")
    prefill = serve.get_deployment_handle(f"prefill:{SPLIT}", app_name="orchard")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Split conversation: name a lake."}]
    answer = client.chat.completions.create(model=SPLIT, messages=messages,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=8)
    assert answer.usage is not None and answer.usage.prompt_tokens > 64
    assert answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == answer.usage.prompt_tokens - 1
    pulls = decode.stats.remote().result(timeout_s=60)["pulls"]
    assert pulls["outcomes"] == {"prefill pulled": 1}, pulls
    assert prefill.stats.remote().result(timeout_s=60)["submitted"] == 1
    whole = client.chat.completions.create(model=SPREAD, messages=messages,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=8)
    assert answer.choices[0].message.content == whole.choices[0].message.content
    short = client.chat.completions.create(model=SPLIT, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert short.choices[0].finish_reason in ("stop", "length")
    assert prefill.stats.remote().result(timeout_s=60)["submitted"] == 1  # not handed over


# ---- memory-aware routing --------------------------------------------------------------


def token_prompt(seed: int, n: int) -> list[int]:
    """`n` ordinary token ids of the tiny model (a token prompt: the router counts it exactly)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def start_blocker(client: openai.OpenAI, prompt: list[int]) -> Stream[Completion]:
    """A stream that holds most of a replica's KV until closed."""
    bias = {token: int(value) for token, value in never_end_bias().items()}
    return cast(Stream[Completion], client.completions.create(
        model=HEADROOM, prompt=prompt, max_tokens=BLOCKER_OUTPUT, temperature=0, stream=True,
        logit_bias=bias))


def decoding(blocker: Stream[Completion]) -> bool:
    chunk = next(blocker)
    return bool(chunk.choices) and chunk.choices[0].finish_reason is None


def landed(before: dict[str, int], timeout_s: float = 120) -> str:
    """The replica whose `submitted` count grew past `before`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        after = submitted(HEADROOM)
        grew = [r for r in after if after[r] > before.get(r, 0)]
        if grew:
            assert len(grew) == 1, (before, after)
            return grew[0]
        time.sleep(0.5)
    raise AssertionError(f"no replica took the request: {before}")


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_a_turn_leaves_its_cache_holder_when_that_one_has_no_kv_room(
        client: openai.OpenAI) -> None:
    handle = serve.get_deployment_handle(f"model:{HEADROOM}", app_name="orchard")
    stats = handle.record_routing_stats.remote().result(timeout_s=60)
    assert stats["kv_budget_tokens"] == BUDGET_TOKENS  # the figure this test is built on
    first = token_prompt(1, BLOCKER_PROMPT)
    before = submitted(HEADROOM)
    blocker = start_blocker(client, first)
    try:
        holder = landed(before)
        time.sleep(STATS_SETTLE_S)
        # The next request extends the blocker's prompt, so the router prefers its replica
        # (one ongoing request more than the other: within max_imbalance); but the holder
        # has no room for the longer prompt beside the running one.
        before = submitted(HEADROOM)
        probe = first + token_prompt(2, PROBE_PROMPT - BLOCKER_PROMPT)
        answer = client.completions.create(model=HEADROOM, prompt=probe, max_tokens=4,
                                           temperature=0)
        assert answer.choices[0].finish_reason == "length"
        after = submitted(HEADROOM)
        assert after[holder] == before[holder], "the turn went to the replica without room"
        assert sum(after.values()) == sum(before.values()) + 1
        assert decoding(blocker)  # it held its replica's KV throughout
    finally:
        blocker.close()


def test_a_request_no_replica_has_room_for_is_shed_as_overloaded(
        client: openai.OpenAI) -> None:
    blockers = []
    try:
        for seed in (3, 4):  # the second goes where the first left room: the other replica
            before = submitted(HEADROOM)
            blockers.append(start_blocker(client, token_prompt(seed, BLOCKER_PROMPT)))
            landed(before)
            time.sleep(STATS_SETTLE_S)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=HEADROOM, prompt=token_prompt(5, PROBE_PROMPT),
                                      max_tokens=4, temperature=0)
        assert time.monotonic() - started < 30  # refused by the router, not after a wait
        error = refused.value
        assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
        body = error.body
        assert isinstance(body, dict) and body["type"] == "overloaded_error", body
        assert "has KV memory" in body["message"]
        for blocker in blockers:
            assert decoding(blocker)  # still running: neither replica had to refuse it
    finally:
        for blocker in blockers:
            blocker.close()
