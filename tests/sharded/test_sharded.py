"""One model across two processes on two Ray nodes (issue 22), over HTTP with the openai SDK.

Greedy text from a sharded replica must equal the whole model's, streamed and not; stops,
reasoning, guided JSON and tool calls work on it; concurrent streams keep their own
answers (with speculative decoding too); a split model's KV moves rank to rank; a lost or
frozen shard, or a failed step on rank 0, fails the whole replica, Serve
replaces it, its streams resume on the replacement, and nothing of the old group is left
behind: no process, no port (issue 32).
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jsonschema
import openai
import pytest

from replicas.builtin import script
from replicas.engine import failpoints
from tests.cluster.conftest import BASE_URL, LocalCluster
from tests.reliability.wire import never_end_bias
from tests.sharded.driver import Driver
from tests.sharded.group import alive, assert_replaced, group_of, running_replicas, \
    shard_actors
from tests.sharded.conftest import FAULTED, FAULTED_HEALTH_PERIOD_S, HEARTBEAT_TIMEOUT_S, PAIRS, \
    RESUME_WAIT_S, SMALL_BUDGET, SMALL_BUDGET_TOKENS, SPECULATING, SPLIT, SPLIT_MIN_TOKENS

pytestmark = pytest.mark.cluster

# Prompts the bench and pipe models (random weights) continue with gibberish, which is what
# makes them a fair test: every token is an argmax over near-uniform logits.
# The failed health checks in a row Serve waits for before it replaces a replica
# (`REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD`; FAULTED_HEALTH_PERIOD_S apart), and its
# controller's slack (on a busy two-core box: the checks come late there).
SERVE_FAILED_CHECKS = 3
CONTROL_LOOP_S = 10.0
# From a freeze until the frozen rank is gone: detection, the replica's graceful stop, the
# shards' stop grace (10 s) and Ray ending a process that cannot answer it.
TEARDOWN_S = 120.0
# The fault tests' stream: the fault strikes at its fifth chunk, and the ingress finds the
# replica failed within a token or two of it (ring steps need every rank), so the rest comes
# from the replacement; `_assert_resumed` checks that it did.
STREAM_TOKENS = 120
LOGGED_S = 60.0  # from the stream's end until the ingress's log line is on disk
PROMPTS = ["List five of the largest cities in the world.", "Tell me about the ocean.",
           "Write a haiku about the moon."]


@pytest.fixture(scope="module")
def client(sharded_cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def generate(client: openai.OpenAI, model: str, prompt: str, stream: bool,
             **extra: Any) -> tuple[str, str | None]:
    args: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": 48,
                            "messages": [{"role": "user", "content": prompt}], **extra}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


# The whole models' greedy answers, by (model, prompt): each is asked once, however many
# sharded models and stream modes are checked against it.
_WHOLE: dict[tuple[str, str], tuple[str, str | None]] = {}


def whole_text(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, str | None]:
    """The unsharded `model`'s greedy answer to `prompt` (not streamed)."""
    if (model, prompt) not in _WHOLE:
        _WHOLE[model, prompt] = generate(client, model, prompt, stream=False)
    return _WHOLE[model, prompt]


@pytest.mark.parametrize("whole,sharded", [(w, s) for w, s, _ in PAIRS])
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_is_the_whole_models(client: openai.OpenAI, whole: str, sharded: str,
                                         stream: bool) -> None:
    for prompt in PROMPTS:
        expected = whole_text(client, whole, prompt)
        got = generate(client, sharded, prompt, stream=stream)
        assert got == expected, (sharded, prompt)
        assert len(expected[0]) > 20  # a real continuation, not an empty pair


def test_bench_sharded_is_deterministic_streamed_or_not(client: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        first = generate(client, "bench-x2", prompt, stream=False)
        assert generate(client, "bench-x2", prompt, stream=True) == first
        assert first[1] == "length" and len(first[0]) > 20


@pytest.mark.parametrize("whole,sharded", [(w, s) for w, s, _ in PAIRS])
def test_echo_scores_the_prompt_on_every_rank(client: openai.OpenAI, whole: str,
                                              sharded: str) -> None:
    """`echo` + `logprobs` runs the scoring prefill on every rank (a lockstep record that no
    step follows): the numbers equal the whole model's, and the batch stays in step after."""
    for prompt in PROMPTS:
        args: dict[str, Any] = dict(prompt=prompt, temperature=0, max_tokens=8, logprobs=2,
                                    echo=True)
        expected = client.completions.create(model=whole, **args).choices[0]
        got = client.completions.create(model=sharded, **args).choices[0]
        assert got.text == expected.text and got.text.startswith(prompt)
        assert got.logprobs.tokens == expected.logprobs.tokens
        assert got.logprobs.token_logprobs[0] is None
        assert got.logprobs.token_logprobs[1:] == pytest.approx(
            expected.logprobs.token_logprobs[1:], abs=0.05)
    assert generate(client, sharded, PROMPTS[0], stream=True) == \
        whole_text(client, whole, PROMPTS[0])


@pytest.mark.parametrize("stream", [False, True])
def test_a_quantized_kv_cache_shards_as_the_whole_model(client: openai.OpenAI,
                                                        stream: bool) -> None:
    for prompt in PROMPTS:
        assert generate(client, "tiny-q8-x2", prompt, stream) == \
            whole_text(client, "tiny-q8", prompt)


def test_shards_are_spread_one_per_node(sharded_cluster: LocalCluster) -> None:
    nodes = set(sharded_cluster.node_ids().values())
    app = sharded_cluster.app()
    for sharded in [s for _, s, _ in PAIRS] + ["bench-x2"]:
        (replica,) = app["deployments"][f"model:{sharded}"]["replicas"]
        workers = shard_actors(sharded_cluster, sharded)
        assert len(workers) == 1, workers
        # Rank 0 (the Serve replica) and rank 1 (its actor) on the two different nodes.
        assert {replica["node_id"], workers[0]["node_id"]} == nodes


def test_pipeline_stages_follow_the_nodes_memory(driver: Driver) -> None:
    """`pipe-u2`'s nodes are configured with 3 and 1 GiB: its 4 layers split 3 (rank 0, the
    last three) and 1, each rank checks it holds exactly its stage at load, and its greedy
    text equals the whole model's (test_greedy_text_is_the_whole_models). `pipe-x2`'s
    nodes are equal: mlx-lm's even split."""
    stats = driver.stats("pipe-u2", "pipe-x2")
    assert stats["pipe-u2"]["pipeline_layers"] == [3, 1]
    assert stats["pipe-x2"]["pipeline_layers"] is None


def test_every_rank_keeps_its_own_budget_and_preempts_in_lockstep(
        client: openai.OpenAI, driver: Driver) -> None:
    """`tiny-m2` (tiny by tensor, SMALL_BUDGET of KV on each Mac): each rank measured its
    own KV and set its own MLX limit (rank 1's read in its own process), admission takes the
    tightest, and four requests without max_tokens, which outgrow the budget together, are
    preempted and resumed in lockstep and give the whole model's greedy text."""
    bias = {token: int(value) for token, value in never_end_bias().items()}
    prompts = [f"{p} Say more, number {i}." for i, p in enumerate(PROMPTS * 2)][:4]
    patient = client.with_options(timeout=600)  # mostly one row at a time, every step synced

    def run(model: str, prompt: str, max_tokens: int | None) -> tuple[str, int, int]:
        answer = patient.chat.completions.create(
            model=model, temperature=0, logit_bias=bias, max_tokens=max_tokens,
            messages=[{"role": "user", "content": prompt}])
        assert answer.choices[0].finish_reason == "length" and answer.usage is not None
        return (answer.choices[0].message.content or "", answer.usage.prompt_tokens,
                answer.usage.completion_tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        sharded = list(pool.map(lambda p: run("tiny-m2", p, None), prompts))
    memory = driver.stats("tiny-m2")["tiny-m2"]["memory"]
    assert [budget for budget, _ in memory["ranks"]] == [SMALL_BUDGET, SMALL_BUDGET]
    assert memory["budget_bytes"] == SMALL_BUDGET  # equal ranks: the tightest is either
    limits = driver.limits("tiny-m2")
    assert limits == [memory["ranks"][1][1]]  # rank 1 set the limit its own figures give
    assert memory["preempted"] > 0 and memory["projected_bytes"] == 0
    for prompt, (text, prompt_tokens, completion_tokens) in zip(prompts, sharded):
        # Each ran to the 512 tokens one sequence may hold, as the whole model writes it.
        assert prompt_tokens + completion_tokens == SMALL_BUDGET_TOKENS // 256 * 256
        assert text == run("tiny", prompt, completion_tokens)[0], prompt


def test_a_split_sharded_model_moves_each_rank_s_kv_to_the_same_rank(
        client: openai.OpenAI, driver: Driver) -> None:
    """Prefill and decode roles on replicas sharded by tensor: a long prompt is prefilled
    by the prefill replica's two ranks, and each rank's part of the KV (its KV head) goes
    to the decode replica's same rank, rank 1's without passing through rank 0. Every
    prompt token but the last is served from the moved KV, and the text is the whole
    model's."""
    messages = [{"role": "system", "content": "You are a careful assistant. " * 20},
                {"role": "user", "content": PROMPTS[0]}]
    args: dict[str, Any] = {"temperature": 0, "max_tokens": 32, "messages": messages}
    answer = client.chat.completions.create(model=SPLIT, **args)
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens > SPLIT_MIN_TOKENS
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    stats = driver.stats(SPLIT, f"prefill:{SPLIT}")
    pulls = stats[SPLIT]["pulls"]
    assert pulls["outcomes"] == {"prefill pulled": 1}, pulls
    assert pulls["tokens"] == usage.prompt_tokens - 1
    # Rank 0's part alone came with the answer: half of tiny's 1024 bytes a token.
    assert pulls["bytes"] < 0.6 * 1024 * pulls["tokens"], pulls
    assert stats[f"prefill:{SPLIT}"]["submitted"] == 1
    assert answer.choices[0].message.content == \
        client.chat.completions.create(model="tiny", **args).choices[0].message.content


@pytest.mark.parametrize("model", ["tiny-x2", SPECULATING])
def test_scripted_answers_stops_reasoning_json_and_tools(client: openai.OpenAI, model: str,
                                                         driver: Driver) -> None:
    """The scripts as the whole model writes them; on `tiny-s2` with speculation, rank 0's
    drafts verified by both ranks in one pass (greedy output must not change)."""
    before = driver.stats(model)[model]["decode"]
    cities = script("cities")
    full = client.chat.completions.create(model=model, messages=cities.message_dicts,
                                          temperature=0, max_tokens=200)
    assert full.choices[0].message.content == cities.answer
    stopped = client.chat.completions.create(model=model, messages=cities.message_dicts,
                                             temperature=0, stop=["3."], max_tokens=200)
    assert stopped.choices[0].message.content == cities.answer.split("3.")[0]
    assert stopped.choices[0].finish_reason == "stop"
    extra = stopped.choices[0].model_extra
    assert extra and extra["matched_stop"] == "3."

    think = script("feathers-think")
    body = client.chat.completions.create(model=model, messages=think.message_dicts,
                                          temperature=0, max_tokens=400)
    message = body.choices[0].message
    assert message.content == think.answer
    assert message.model_extra and message.model_extra["reasoning_content"] == think.reasoning

    # The script whose answer is a JSON record, under a strict schema it meets: the
    # grammar lets the sharded model say it as is (off-script text need not close).
    record = script("json-record")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "born": {"type": "integer"},
        "country": {"type": "string"}, "skills": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"}},
        "required": ["name", "born"], "additionalProperties": False}
    guided = client.chat.completions.create(
        model=model, messages=record.message_dicts, temperature=0,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": schema, "strict": True}})
    answer = json.loads(guided.choices[0].message.content or "")
    jsonschema.validate(answer, schema)
    assert answer == json.loads(record.answer)

    tools = script("tool-one")
    called = client.chat.completions.create(
        model=model, messages=tools.message_dicts, tools=tools.tool_dicts, temperature=0,
        max_tokens=200, extra_body={"chat_template_kwargs": tools.template_kwargs})
    assert called.choices[0].finish_reason == "tool_calls"
    calls = called.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(name, json.loads(args)) for name, args in tools.expected_calls]
    decode = driver.stats(model)[model]["decode"]
    if model == SPECULATING:  # drafts were verified, some kept: more than a token a pass
        assert decode["speculative"] and decode["drafted"] > before["drafted"]
        assert decode["accepted"] > before["accepted"]
        assert decode["tokens"] - before["tokens"] > decode["passes"] - before["passes"]
    else:
        assert decode["drafted"] == 0


def test_sampled_drafts_on_a_sharded_replica_are_kept_by_the_qp_rule(
        client: openai.OpenAI, driver: Driver) -> None:
    """Unseeded sampled requests on `tiny-s2`: rank 0's draft model samples the drafts, rank
    0 judges them by the q/p rule and shares what it kept; the draft agrees with the model
    (it is the model), so nearly all are kept, and every stream completes on both ranks."""
    before = driver.stats(SPECULATING)[SPECULATING]["decode"]
    words = "river stone apple quiet seven lantern orbit maple copper violet tide".split()
    prompts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(6)) for i in range(6)]

    def ask(prompt: str) -> str:
        return client.completions.create(model=SPECULATING, prompt=prompt, temperature=1.0,
                                         top_p=0.95, max_tokens=32).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, prompts))
    assert all(texts)
    decode = driver.stats(SPECULATING)[SPECULATING]["decode"]
    drafted = decode["drafted"] - before["drafted"]
    # Drafts past a row's end count as drafted, not kept ("sample, then compare": ~0.35).
    assert drafted > 20 and decode["accepted"] - before["accepted"] >= 0.75 * drafted, decode


@pytest.mark.parametrize("model", ["tiny-x2", SPECULATING])
def test_eight_concurrent_streams_keep_their_own_answers(client: openai.OpenAI,
                                                         model: str) -> None:
    ids = ["cities", "planets", "tea-steps", "ocean-prose", "haiku", "hello", "unicode",
           "two-paragraphs"]

    def run(sid: str) -> str:
        s = script(sid)
        text = []
        for chunk in client.chat.completions.create(
                model=model, messages=s.message_dicts, temperature=0, max_tokens=300,
                stream=True):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
        return "".join(text)

    with ThreadPoolExecutor(len(ids)) as pool:
        answers = list(pool.map(run, ids))
    assert answers == [script(sid).answer for sid in ids]


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_lost_or_frozen_shard_fails_the_replica_and_its_stream_resumes(
        sharded_cluster: LocalCluster, client: openai.OpenAI, fault: str) -> None:
    """Kill rank 1, or freeze it (a Mac asleep): the replica fails as a whole (a frozen one
    misses its heartbeats), Serve replaces it with every rank, and the stream that was
    running goes on on the replacement: one stream, every token, no error. Nothing of the
    old group is left: no process (the frozen rank was killed with it), no port."""
    model = FAULTED  # random weights never pick EOS: the stream runs until max_tokens
    _wait_serving(client, model)
    old = group_of(sharded_cluster, model)
    _stream_through_fault(sharded_cluster, client, model,
                          lambda: os.kill(old.pids[1], getattr(signal, fault)))
    assert_replaced(sharded_cluster, model, old)


def test_a_failed_step_on_rank_0_fails_the_replica_and_its_stream_resumes(
        sharded_cluster: LocalCluster, client: openai.OpenAI) -> None:
    """A batch step that raises on rank 0 (a test-only failpoint: `replicas.engine.failpoints`)
    takes the real path of a failed step: a sharded batch cannot start over (rank 1 may be
    mid-step), so the engine stops at once, its requests get the replica's fault, the health
    check fails and Serve replaces the replica with every rank. The stream resumes on the
    replacement, and both old ranks' processes and ports are gone."""
    model = FAULTED
    _wait_serving(client, model)
    old = group_of(sharded_cluster, model)
    armed = Path(sharded_cluster.env[failpoints.ENV])
    with open(f"/proc/{old.pids[0]}/environ", "rb") as environ:  # Ray workers inherit it
        assert f"{failpoints.ENV}={armed}".encode() in environ.read().split(b"\0")
    _stream_through_fault(sharded_cluster, client, model,
                          lambda: failpoints.arm(armed, "step", model))
    # Fired once, by the old rank 0: the replacement found the failpoint claimed.
    assert [p.name for p in armed.glob(f"step.{model}*")] == \
        [f"step.{model}.fired.{old.pids[0]}"]
    assert_replaced(sharded_cluster, model, old)


def _wait_serving(client: openai.OpenAI, model: str) -> None:
    """Until `model` answers: a test before may have left it replacing a shard."""
    ask: dict[str, Any] = {"model": model, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "Hi"}]}
    deadline = time.monotonic() + RESUME_WAIT_S
    while True:
        try:
            client.chat.completions.create(**ask)
            return
        except openai.APIError:
            assert time.monotonic() < deadline, f"{model} did not serve again"
            time.sleep(2)


def _stream_through_fault(cluster: LocalCluster, client: openai.OpenAI, model: str,
                          fault: Callable[[], object]) -> None:
    """One STREAM_TOKENS-token stream, `fault` injected mid-stream: it must still end whole,
    and the ingress must have resumed it (its log says so), so it cannot pass by having
    ended before the fault struck."""
    stream = client.chat.completions.create(
        model=model, temperature=0, max_tokens=STREAM_TOKENS, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPTS[1]}])
    received, usage, reason, request = 0, None, None, ""
    for chunk in stream:
        received += 1
        request = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            reason = chunk.choices[0].finish_reason or reason
        if received == 5:  # mid-stream: the first chunks are out
            fault()
    assert usage is not None and usage.completion_tokens == STREAM_TOKENS \
        and reason == "length"
    _assert_resumed(cluster, request, model)


def _assert_resumed(cluster: LocalCluster, request: str, model: str) -> None:
    """The ingress logged that `request`'s replica failed under it: the stream went on on
    another (`deployments.model_clients`; its process's stderr, in the head's session)."""
    line = f"request {request} to '{model}': its replica failed"
    deadline = time.monotonic() + LOGGED_S
    while not any(line in path.read_text(errors="replace")
                  for path in cluster.session_logs().glob("worker-*.err")):
        assert time.monotonic() < deadline, f"no resume of {request} logged: {line!r}"
        time.sleep(1)


def test_an_idle_frozen_shard_is_found_by_its_heartbeat(
        sharded_cluster: LocalCluster, client: openai.OpenAI) -> None:
    """Freeze rank 1 of a replica that serves nothing (a Mac gone to sleep overnight): no
    step runs into it, so only the heartbeat can notice. The replica fails within the
    heartbeat timeout, and Serve takes it out of service after three failed health checks
    (FAULTED_HEALTH_PERIOD_S apart), instead of the first request hours later finding a
    wedged group; the frozen process goes with it."""
    model = FAULTED
    _wait_serving(client, model)  # the model may still be replacing a shard
    running = set(running_replicas(sharded_cluster, model))
    (worker,) = shard_actors(sharded_cluster, model)
    frozen = time.monotonic()
    os.kill(worker["pid"], signal.SIGSTOP)
    bound = HEARTBEAT_TIMEOUT_S + SERVE_FAILED_CHECKS * FAULTED_HEALTH_PERIOD_S + CONTROL_LOOP_S
    while running & set(running_replicas(sharded_cluster, model)):
        waited = time.monotonic() - frozen
        assert waited < bound, f"rank 1 frozen {waited:.0f} s; its replica still serves"
        time.sleep(0.5)
    found = time.monotonic() - frozen
    assert found >= HEARTBEAT_TIMEOUT_S  # no sooner: nothing else could have noticed
    print(f"frozen idle shard: replica out of service after {found:.1f} s (bound {bound:g} s)")
    while alive(worker["pid"]):  # and the frozen process is ended, not left behind
        assert time.monotonic() - frozen < TEARDOWN_S, "the frozen rank outlived its replica"
        time.sleep(1)
