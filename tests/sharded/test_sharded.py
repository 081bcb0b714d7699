"""One model across two processes on two Ray nodes (issue 22), over HTTP with the openai SDK.

Greedy text from a sharded replica must equal the whole model's, streamed and not; stops,
reasoning, guided JSON and tool calls work on it; concurrent streams keep their own
answers; a lost or frozen shard fails the whole replica, Serve replaces it, and its streams
resume on the replacement (issue 32).
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from replicas.builtin import script
from tests.cluster.conftest import BASE_URL, DASHBOARD, LocalCluster
from tests.sharded.conftest import PAIRS

pytestmark = pytest.mark.cluster

# Prompts the bench and pipe models (random weights) continue with gibberish, which is what
# makes them a fair test: every token is an argmax over near-uniform logits.
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


@pytest.mark.parametrize("whole,sharded", [(w, s) for w, s, _ in PAIRS])
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_is_the_whole_models(client: openai.OpenAI, whole: str, sharded: str,
                                         stream: bool) -> None:
    for prompt in PROMPTS:
        expected = generate(client, whole, prompt, stream=False)
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
        generate(client, whole, PROMPTS[0], stream=False)


def test_shards_are_spread_one_per_node(sharded_cluster: LocalCluster) -> None:
    nodes = set(sharded_cluster.node_ids().values())
    app = sharded_cluster.app()
    for sharded in [s for _, s, _ in PAIRS] + ["bench-x2"]:
        (replica,) = app["deployments"][f"model:{sharded}"]["replicas"]
        workers = _shard_actors(sharded_cluster, sharded)
        assert len(workers) == 1, workers
        # Rank 0 (the Serve replica) and rank 1 (its actor) on the two different nodes.
        assert {replica["node_id"], workers[0]["node_id"]} == nodes


def test_scripted_answers_stops_reasoning_json_and_tools(client: openai.OpenAI) -> None:
    cities = script("cities")
    full = client.chat.completions.create(model="tiny-x2", messages=cities.message_dicts,
                                          temperature=0, max_tokens=200)
    assert full.choices[0].message.content == cities.answer
    stopped = client.chat.completions.create(model="tiny-x2", messages=cities.message_dicts,
                                             temperature=0, stop=["3."], max_tokens=200)
    assert stopped.choices[0].message.content == cities.answer.split("3.")[0]
    assert stopped.choices[0].finish_reason == "stop"
    extra = stopped.choices[0].model_extra
    assert extra and extra["matched_stop"] == "3."

    think = script("feathers-think")
    body = client.chat.completions.create(model="tiny-x2", messages=think.message_dicts,
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
        model="tiny-x2", messages=record.message_dicts, temperature=0,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": schema, "strict": True}})
    answer = json.loads(guided.choices[0].message.content or "")
    jsonschema.validate(answer, schema)
    assert answer == json.loads(record.answer)

    tools = script("tool-one")
    called = client.chat.completions.create(
        model="tiny-x2", messages=tools.message_dicts, tools=tools.tool_dicts, temperature=0,
        max_tokens=200, extra_body={"chat_template_kwargs": tools.template_kwargs})
    assert called.choices[0].finish_reason == "tool_calls"
    calls = called.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(name, json.loads(args)) for name, args in tools.expected_calls]


def test_eight_concurrent_streams_keep_their_own_answers(client: openai.OpenAI) -> None:
    ids = ["cities", "planets", "tea-steps", "ocean-prose", "haiku", "hello", "unicode",
           "two-paragraphs"]

    def run(sid: str) -> str:
        s = script(sid)
        text = []
        for chunk in client.chat.completions.create(
                model="tiny-x2", messages=s.message_dicts, temperature=0, max_tokens=300,
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
    running goes on on the replacement: one stream, every token, no error."""
    model = "bench-x2"  # random weights never pick EOS: the stream runs until max_tokens
    (worker,) = _shard_actors(sharded_cluster, model)
    stream = client.chat.completions.create(
        model=model, temperature=0, max_tokens=600, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPTS[1]}])
    received, usage, reason = 0, None, None
    for chunk in stream:
        received += 1
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            reason = chunk.choices[0].finish_reason or reason
        if received == 5:  # mid-stream: the first chunks are out
            os.kill(worker["pid"], getattr(signal, fault))
    assert usage is not None and usage.completion_tokens == 600 and reason == "length"
    (replacement,) = _shard_actors(sharded_cluster, model)
    assert replacement["pid"] != worker["pid"]
    # Nothing of the old replica is left: the frozen rank was killed with it.
    deadline = time.monotonic() + 60
    while _alive(worker["pid"]):
        assert time.monotonic() < deadline, f"rank 1 (pid {worker['pid']}) outlived its replica"
        time.sleep(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone but for its parent's wait
        return stat.read().split(") ")[-1][:1] != "Z"


def _shard_actors(cluster: LocalCluster, model: str) -> list[dict[str, Any]]:
    """The live rank-1 actors of `model`'s replicas (named by `deployments.shards`)."""
    r = httpx.get(f"{DASHBOARD}/api/v0/actors?limit=1000&detail=true", timeout=30,
                  headers={"Authorization": f"Bearer {cluster.token}"})
    r.raise_for_status()
    actors = r.json()["data"]["result"]["result"]
    return [a for a in actors if a["state"] == "ALIVE"
            and (a.get("name") or "").startswith(f"orchard-shard:{model}:")]
