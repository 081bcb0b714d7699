"""Speculative decoding over a real `serve run` of the default config, with the official
SDKs over loopback, once per method: prompt lookup (`method: ngram`) and a draft model
(`method: draft`, the built-in model drafting for itself), each on a model of its own.

Greedy output must be the output without speculation: the built-in model reproduces its
scripts exactly, so every API (Chat Completions, Responses, Anthropic Messages), streamed
and not, must still give the scripted text, reasoning, stops and calls, guided ones (JSON
schemas, forced tool calls) included: their grammar checks each draft as it is kept.
Off-script guided outputs must not change when they share passes with other rows. Then the speculative metrics must show drafts verified
and more than one token per target pass for one row at a time.

One server for the module: the config's model twice, one per method (an ingress replica in
front of the two), so one Ray start serves both methods' tests.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import yaml

from replicas.builtin import ensure_builtin, script
from tests.e2e.test_anthropic_http import PLAIN
from tests.e2e.test_anthropic_http import args as anthropic_text_args
from tests.e2e.test_anthropic_http import text_of
from tests.e2e.test_features_http import SCHEMA as PROFILE_SCHEMA
from tests.e2e.test_openai_http import chat_args, stream_chat
from tests.e2e.test_responses_http import (
    calls,
    check_streamed,
    reasoning_text,
    response_args,
)
from tests.e2e.test_tools_http import UNIT_TOOL, anthropic_args, calls_of, stream_calls, uses_of
from tests.e2e.test_tools_http import chat_args as tool_chat_args
from tests.observability.test_observability_http import App, _samples, _total
from tests.serve_process import ROOT, config_copy, free_port, ready, serve_run

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"  # the config's model, speculating by each method under an id of its own
METHODS = {
    # The config's block, with prompt_lookup_min 1: the scripts' outputs repeat little of
    # their prompts, and single-token matches draft (and so verify and reject) far more.
    # Both draft at every size (`disable_when_slower: false`): these tests watch the
    # drafts, which the speculation gate would stop wherever this CPU found them slower.
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 1, "disable_by_batch_size": None,
              "disable_when_slower": False},
    # The model drafting for itself: every greedy draft kept, so every script's tokens
    # come through runs of kept drafts.
    "draft": {"method": "draft", "draft_model": "builtin:tiny", "num_speculative_tokens": 4,
              "disable_by_batch_size": None, "disable_when_slower": False},
}
MODELS = {"ngram": MODEL, "draft": f"{MODEL}-draft"}
SPEC_METRICS = ("orchard_spec_target_passes_total", "orchard_spec_output_tokens_total",
                "orchard_spec_draft_tokens_total", "orchard_spec_accepted_tokens_total")
METRICS_DEADLINE_S = 120.0


@pytest.fixture(scope="module", params=sorted(METHODS))
def method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(method: str) -> str:
    """The model that speculates by `method`."""
    return MODELS[method]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """The real serve_config.yaml, its model once per method, speculating, on a free port,
    with a Ray temp dir (its metrics discovery file names this app's ports only) and an
    Orchard cache of its own (the built-in models linked in, as `private_serve` does),
    metrics every half second."""
    from replicas.builtin.build import default_cache_root

    ensure_builtin("tiny")
    tmp = tmp_path_factory.mktemp("spec")
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "builtin").symlink_to(default_cache_root(), target_is_directory=True)
    real = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    [base] = real["applications"][0]["args"]["models"]
    assert base["id"] == MODEL
    models = [{**base, "id": MODELS[m], "speculative": dict(METHODS[m])} for m in METHODS]
    port = free_port()
    path = config_copy(tmp, port, models=models)
    config = yaml.safe_load(path.read_text())
    config["applications"][0]["args"]["observability"] = {"metrics_interval_s": 0.5}
    path.write_text(yaml.safe_dump(config))
    ray_tmp = Path(tempfile.mkdtemp(prefix="ors-", dir="/tmp"))
    env = {"ORCHARD_CACHE_DIR": str(cache), "RAY_TMPDIR": str(ray_tmp),
           "RAY_metrics_report_interval_ms": "1000"}
    try:
        with serve_run(path, port, tmp / "serve.log", env=env) as serve:
            deadline = time.monotonic() + 300
            with httpx.Client() as http:  # the other model up too, not only the first
                while not ready(http, serve.base_url, MODELS["draft"]):
                    assert serve.proc.poll() is None and time.monotonic() < deadline, \
                        f"{MODELS['draft']} did not come up; log:\n{serve.log()[-5000:]}"
                    time.sleep(1)
            yield App(serve, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def oai(app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.serve.base_url}/v1", api_key="unused",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(app: App) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.serve.base_url, api_key="unused", max_retries=0,
                               timeout=120)


# ---- greedy identity, one request at a time -----------------------------------------------


@pytest.mark.parametrize("sid", ["cities", "tea-steps", "unicode", "sum-think",
                                 "feathers-think", "riddle-nothink"])
def test_chat_scripts_are_exact_streamed_or_not(oai: openai.OpenAI, model: str,
                                               sid: str) -> None:
    # `check_chat_script` of the OpenAI module, on this method's model.
    full = oai.chat.completions.create(**chat_args(sid, model=model))
    content, reasoning, final = stream_chat(oai, **chat_args(sid, model=model))
    message = full.choices[0].message
    assert message.content == content == script(sid).answer
    assert (getattr(message, "reasoning_content", None) or "") == reasoning \
        == (script(sid).reasoning or "")
    assert full.choices[0].finish_reason == final.finish_reason == "stop"


def test_completion_script_is_exact_streamed_or_not(oai: openai.OpenAI, model: str) -> None:
    s = script("count-completion")
    full = oai.completions.create(model=model, prompt=s.prompt, temperature=0, max_tokens=100)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=model, prompt=s.prompt, temperature=0, max_tokens=100, stream=True) if c.choices)
    assert full.choices[0].text == streamed == s.answer


# A stop string can complete inside a pass's accepted drafts: what follows it in that pass
# must not leak. "\n5" ends one token after "4. Mars" would; "How can I help" spans tokens.
@pytest.mark.parametrize(("sid", "stops"), [
    ("planets", ["4. Mars", "Jupiter", "zzz", "\n5"]),
    ("hello", ["How can I help"]),
    ("tea-steps", ["Step 3"]),
    ("cities", ["\n"]),
])
def test_chat_stop_strings_cut_exactly_streamed_or_not(oai: openai.OpenAI, model: str, sid: str,
                                                       stops: list[str]) -> None:
    text = script(sid).answer
    _, _, winner = min((text.index(s) + len(s), i, s) for i, s in enumerate(stops) if s in text)
    expected = text[: text.index(winner)]
    body = oai.chat.completions.create(**chat_args(sid, stop=stops, model=model))
    content, _, final = stream_chat(oai, **chat_args(sid, stop=stops, model=model))
    assert body.choices[0].message.content == content == expected
    assert body.choices[0].finish_reason == final.finish_reason == "stop"
    assert body.choices[0].model_extra["matched_stop"] == final.model_extra["matched_stop"] \
        == winner


def test_chat_max_tokens_cuts_at_the_count(oai: openai.OpenAI, model: str) -> None:
    # Accepted drafts must not run past max_tokens.
    s = script("tool-parallel")
    for n in (3, 7, 13):
        body = oai.chat.completions.create(**tool_chat_args("tool-parallel", max_tokens=n,
                                                            model=model))
        assert body.choices[0].finish_reason == "length"
        assert body.usage.completion_tokens == n
        assert s.answer.startswith(body.choices[0].message.content or "")


@pytest.mark.parametrize("sid", ["tool-one", "tool-parallel", "tool-text-then-call",
                                 "tool-after-reasoning"])
def test_chat_tool_calls_are_exact_streamed_or_not(oai: openai.OpenAI, model: str,
                                                   sid: str) -> None:
    s = script(sid)
    full = oai.chat.completions.create(**tool_chat_args(sid, model=model))
    assert full.choices[0].finish_reason == "tool_calls"
    assert calls_of(full.choices[0].message) == list(s.expected_calls)
    assert (full.choices[0].message.content or "").rstrip("\n") == s.answer_text
    final, pieces = stream_calls(oai, **tool_chat_args(sid, model=model))
    assert final.finish_reason == "tool_calls"
    assert calls_of(final.message) == list(s.expected_calls)
    assert pieces == [a for _, a in s.expected_calls]
    assert (getattr(final.message, "reasoning_content", None) or "") == (s.reasoning or "")


def record_format() -> dict[str, Any]:
    """A strict schema that json-record's scripted answer satisfies."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "born": {"type": "integer"}, "country": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
        "required": ["name", "born", "country", "skills", "active"],
        "additionalProperties": False}
    jsonschema.validate(json.loads(script("json-record").answer), schema)
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("response_format", [record_format(), {"type": "json_object"}],
                         ids=["json_schema", "json_object"])
def test_guided_json_is_the_scripted_record_streamed_or_not(
        oai: openai.OpenAI, model: str, response_format: dict[str, Any]) -> None:
    args = chat_args("json-record", response_format=response_format, model=model)
    body = oai.chat.completions.create(**args)
    content, _, final = stream_chat(oai, **args)
    assert body.choices[0].message.content == content == script("json-record").answer
    assert body.choices[0].finish_reason == final.finish_reason == "stop"


def forced_weather(api: str) -> Any:
    return {"type": "function", "function": {"name": "get_weather"}} if api == "chat" else \
        {"type": "function", "name": "get_weather"} if api == "responses" else \
        {"type": "tool", "name": "get_weather"}


def test_forced_tool_calls_have_the_scripted_arguments(oai: openai.OpenAI, model: str,
                                                       claude: anthropic.Anthropic) -> None:
    """A named tool_choice (the tool the script calls: the grammar writes the call, the
    model its arguments) and `required` with one call allowed give the scripted calls."""
    one, parallel = script("tool-one"), script("tool-parallel")
    args = tool_chat_args("tool-one", tool_choice=forced_weather("chat"), model=model)
    full = oai.chat.completions.create(**args)
    assert full.choices[0].finish_reason == "tool_calls"
    assert calls_of(full.choices[0].message) == list(one.expected_calls)
    with oai.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert calls_of(final.message) == list(one.expected_calls)

    single = oai.chat.completions.create(**tool_chat_args(
        "tool-parallel", parallel_tool_calls=False, tool_choice="required", model=model))
    assert calls_of(single.choices[0].message) == list(parallel.expected_calls[:1])

    forced = anthropic_args("tool-one", tool_choice=forced_weather("anthropic"), model=model)
    message = claude.messages.create(**forced)
    assert message.stop_reason == "tool_use" and uses_of(message) == list(one.expected_calls)
    with claude.messages.stream(**forced) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and uses_of(streamed) == list(one.expected_calls)
    any_one = claude.messages.create(**anthropic_args(
        "tool-parallel", tool_choice={"type": "any", "disable_parallel_tool_use": True},
        model=model))
    assert uses_of(any_one) == list(parallel.expected_calls[:1])


@pytest.mark.parametrize("sid", ["hello", "riddle-think"])
def test_responses_text_and_reasoning_are_exact_streamed_or_not(oai: openai.OpenAI, model: str,
                                                                sid: str) -> None:
    s = script(sid)
    for response in (oai.responses.create(**response_args(sid, model=model)),
                     check_streamed(oai, response_args(sid, model=model))):
        assert response.status == "completed" and response.output_text == s.answer
        assert reasoning_text(response) == (s.reasoning or "") and not calls(response)


@pytest.mark.parametrize("sid", ["tool-parallel", "tool-after-reasoning"])
def test_responses_function_calls_are_exact_streamed_or_not(oai: openai.OpenAI, model: str,
                                                            sid: str) -> None:
    s = script(sid)
    for response in (oai.responses.create(**response_args(sid, model=model)),
                     check_streamed(oai, response_args(sid, model=model))):
        assert response.status == "completed", response
        assert calls(response) == list(s.expected_calls)
        assert response.output_text.rstrip("\n") == s.answer_text
        assert reasoning_text(response) == (s.reasoning or "")


def test_responses_forced_call_and_json_schema(oai: openai.OpenAI, model: str) -> None:
    args = response_args("tool-one", tool_choice=forced_weather("responses"), model=model)
    for response in (oai.responses.create(**args), check_streamed(oai, args)):
        assert calls(response) == list(script("tool-one").expected_calls), response
    fmt = record_format()["json_schema"]
    text_format = {"format": {"type": "json_schema", "name": fmt["name"],
                              "schema": fmt["schema"], "strict": True}}
    args = response_args("json-record", text=text_format, model=model)
    for response in (oai.responses.create(**args), check_streamed(oai, args)):
        assert response.output_text == script("json-record").answer, response


def test_anthropic_text_thinking_and_stop_are_exact_streamed_or_not(
        claude: anthropic.Anthropic, model: str) -> None:
    full = claude.messages.create(**anthropic_text_args(PLAIN, model=model))
    with claude.messages.stream(**anthropic_text_args(PLAIN, model=model)) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text_of(full) == streamed == text_of(final) == script(PLAIN).answer
    assert full.stop_reason == final.stop_reason == "end_turn"

    thinking = {"type": "enabled", "budget_tokens": 300}
    s = script("feathers-think")
    message = claude.messages.create(**anthropic_text_args("feathers-think", thinking=thinking,
                                                           model=model))
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert text_of(message, "thinking") == s.reasoning and text_of(message) == s.answer
    with claude.messages.stream(**anthropic_text_args("feathers-think",
                                                      thinking=thinking, model=model)) as stream:
        final = stream.get_final_message()
    assert [getattr(b, "thinking", None) or getattr(b, "text", None) for b in final.content] \
        == [s.reasoning, s.answer]

    stop = "none of them"
    expected = script(PLAIN).answer[: script(PLAIN).answer.index(stop)]
    stops = {"stop_sequences": ["zzz", stop], "model": model}
    cut = claude.messages.create(**anthropic_text_args(PLAIN, **stops))
    with claude.messages.stream(**anthropic_text_args(PLAIN, **stops)) as stream:
        cut_streamed = "".join(stream.text_stream)
        cut_final = stream.get_final_message()
    assert text_of(cut) == cut_streamed == expected
    assert cut.stop_sequence == cut_final.stop_sequence == stop
    assert cut.stop_reason == cut_final.stop_reason == "stop_sequence"


@pytest.mark.parametrize("sid", ["tool-parallel", "tool-after-reasoning"])
def test_anthropic_tool_use_is_exact_streamed_or_not(claude: anthropic.Anthropic, model: str,
                                                     sid: str) -> None:
    s = script(sid)
    full = claude.messages.create(**anthropic_args(sid, model=model))
    with claude.messages.stream(**anthropic_args(sid, model=model)) as stream:
        final = stream.get_final_message()
    for message in (full, final):
        assert message.stop_reason == "tool_use" and uses_of(message) == list(s.expected_calls)
        assert text_of(message, "thinking") == (s.reasoning or "")


# ---- many rows at once --------------------------------------------------------------------


def async_clients(app: App) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    return (openai.AsyncOpenAI(base_url=f"{app.serve.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=180),
            anthropic.AsyncAnthropic(base_url=app.serve.base_url, api_key="unused",
                                     max_retries=0, timeout=180))


async def chat_stream(client: openai.AsyncOpenAI, **args: Any) -> dict[str, Any]:
    """A streamed chat's content, reasoning, calls (arguments joined from their deltas)
    and finish reason."""
    content: list[str] = []
    reasoning: list[str] = []
    pieces: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names[call.index] = call.function.name
            pieces.setdefault(call.index, []).append(
                (call.function.arguments if call.function else None) or "")
        finish = chunk.choices[0].finish_reason or finish
    return {"content": "".join(content), "reasoning": "".join(reasoning),
            "calls": [(names[i], "".join(pieces[i])) for i in sorted(pieces)],
            "finish": finish}


def scripted_chat(sid: str) -> dict[str, Any]:
    s = script(sid)
    return {"content": s.answer_text if s.tools else s.answer, "reasoning": s.reasoning or "",
            "calls": list(s.expected_calls), "finish": "tool_calls" if s.tools else "stop"}


async def eight_streams(app: App, model: str) -> dict[str, tuple[Any, Any]]:
    """Eight streams of different scripts at once (chat, one with tools and one guided, a
    Responses stream and an Anthropic one with thinking): {label: (got, expected)}."""
    oai, claude = async_clients(app)

    async def chat(sid: str, **extra: Any) -> tuple[Any, Any]:
        base = (tool_chat_args if script(sid).tools else chat_args)(sid, model=model)
        got = await chat_stream(oai, **{**base, **extra})
        if script(sid).tools:  # the text before a call, without its separating newline
            got["content"] = got["content"].rstrip("\n")
        return got, scripted_chat(sid)

    async def responses(sid: str) -> tuple[Any, Any]:
        async with oai.responses.stream(**response_args(sid, model=model)) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        return (final.status, reasoning_text(final), final.output_text), \
            ("completed", "", script(sid).answer)

    async def messages(sid: str) -> tuple[Any, Any]:
        args = anthropic_text_args(sid, thinking={"type": "enabled", "budget_tokens": 300},
                                   model=model)
        async with claude.messages.stream(**args) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_message()
        got = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
               for b in final.content]
        s = script(sid)
        return got, [("thinking", s.reasoning), ("text", s.answer)]

    jobs = {"cities": chat("cities"), "planets": chat("planets"),
            "tea-steps": chat("tea-steps"), "sum-think": chat("sum-think"),
            "tool-parallel": chat("tool-parallel"),
            "json-record(json_schema)": chat("json-record", response_format=record_format()),
            "markup(responses)": responses("markup"),
            "feathers-think(messages)": messages("feathers-think")}
    try:
        results = await asyncio.gather(*jobs.values())
    finally:
        await oai.close()
        await claude.close()
    return dict(zip(jobs, results))


def test_eight_concurrent_streams_are_each_exact(app: App, model: str) -> None:
    for _ in range(2):  # two rounds: the rows meet the batch at different steps
        results = asyncio.run(eight_streams(app, model))
        wrong = {label: pair for label, pair in results.items() if pair[0] != pair[1]}
        assert not wrong, json.dumps(wrong, indent=1, ensure_ascii=False)


def test_guided_rows_beside_speculating_rows_keep_their_output(oai: openai.OpenAI, model: str,
                                                               app: App) -> None:
    """Off-script guided outputs (a JSON schema on a prose prompt, a call to a tool no
    script has): valid alone, and the same beside rows that draft, sharing their verifying
    passes (the engine-level tests compare guided rows with and without speculation)."""
    profile = chat_args("profile-prose", response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PROFILE_SCHEMA, "strict": True}}, model=model)
    unit = tool_chat_args("tool-one", tools=[*script("tool-one").tool_dicts, UNIT_TOOL],
                          tool_choice={"type": "function", "function": {"name": "get_unit"}},
                          model=model)
    alone_json = stream_chat(oai, **profile)[0]
    alone_calls = calls_of(oai.chat.completions.create(**unit).choices[0].message)
    jsonschema.validate(json.loads(alone_json), PROFILE_SCHEMA)
    assert [name for name, _ in alone_calls] == ["get_unit"]
    jsonschema.validate(json.loads(alone_calls[0][1]), UNIT_TOOL["function"]["parameters"])

    beside = ("sum-think", "cities", "tea-steps", "planets")  # rows that draft

    async def together() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{app.serve.base_url}/v1", api_key="unused",
                                    max_retries=0, timeout=180)
        try:
            return await asyncio.gather(chat_stream(client, **profile),
                                        chat_stream(client, **unit),
                                        *(chat_stream(client, **chat_args(sid, model=model))
                                          for sid in beside))
        finally:
            await client.close()

    got = asyncio.run(together())
    assert (got[0]["content"], got[1]["calls"]) == (alone_json, alone_calls)
    for result, sid in zip(got[2:], beside):
        assert result == scripted_chat(sid), sid


# ---- the metrics say it happened ----------------------------------------------------------


def spec_counts(app: App, method: str) -> dict[str, float]:
    text = app.scrape()
    return {name: _total(text, name, model=MODELS[method], method=method)
            for name in SPEC_METRICS}


def settled(app: App, method: str, quiet_s: float = 4.0, *,
            past: dict[str, float] | None = None) -> dict[str, float]:
    """The counters once they have not moved for `quiet_s` (and, given `past`, moved past
    it): Ray exports them with a delay."""
    deadline = time.monotonic() + METRICS_DEADLINE_S
    last, since = spec_counts(app, method), time.monotonic()
    while True:
        time.sleep(0.5)
        now = spec_counts(app, method)
        if now != last:
            last, since = now, time.monotonic()
        moved = past is None or now["orchard_spec_target_passes_total"] > \
            past["orchard_spec_target_passes_total"]
        if moved and time.monotonic() - since >= quiet_s:
            return now
        assert time.monotonic() < deadline, (f"speculative metrics did not settle: {now}; "
                                             f"targets {app.metrics_targets()}")


# Plain chat scripts whose answers repeat their context most (tool calls copy more, but a
# row with tools offered carries the tool grammar's controller, and such rows never draft).
SEQUENTIAL = ("sum-think", "cities", "tea-steps", "unicode")


def test_metrics_show_drafts_and_more_than_one_token_per_pass(oai: openai.OpenAI, model: str,
                                                              app: App, method: str) -> None:
    """All the traffic before: drafts verified and kept. Then one row at a time, so a pass
    emits one row's tokens (a batch of n rows emits n per pass without any draft): plain
    scripts whose answers repeat their context emit more than one token per target pass
    on average, and every token they emitted is counted, once."""
    before = settled(app, method)
    print(f"\nspeculative metrics before the sequential phase: {before}")
    text = app.scrape()
    assert {tags.get("method") for name in SPEC_METRICS for tags, _ in _samples(text, name)
            if tags.get("model") == model} == {method}
    assert before["orchard_spec_draft_tokens_total"] > 0, before
    assert 0 < before["orchard_spec_accepted_tokens_total"] <= \
        before["orchard_spec_draft_tokens_total"], before
    assert before["orchard_spec_output_tokens_total"] > \
        before["orchard_spec_target_passes_total"], before

    emitted = 0
    for sid in SEQUENTIAL:
        body = oai.chat.completions.create(**chat_args(sid, model=model))
        assert body.choices[0].message.content == script(sid).answer, sid
        emitted += body.usage.completion_tokens
    after = settled(app, method, past=before)
    delta = {name.removeprefix("orchard_spec_").removesuffix("_total"):
             after[name] - before[name] for name in SPEC_METRICS}
    print(f"\nspeculative metrics, whole run: {after}\nsequential phase: {delta}, "
          f"usage completion tokens {emitted}, tokens per pass "
          f"{delta['output_tokens'] / delta['target_passes']:.2f}")
    assert delta["draft_tokens"] > 0 and delta["accepted_tokens"] > 0, delta
    assert delta["output_tokens"] > delta["target_passes"], delta
    # Nothing else ran: exactly the tokens these requests emitted went through the passes.
    assert delta["output_tokens"] == emitted, (delta, emitted)
