"""MTP speculation (`speculative.method: mtp`) over a real `serve run`, with the official SDKs
over loopback: a DeepSeek V3 model (MLA, MoE) with the MTP layer its checkpoint ships
(`builtin:mtp-agree`, whose layer predicts what the model will), served twice by one app:
`mla` as is and `mla-mtp` drafting with its MTP layer.

Greedy output must be the output without speculation in every API (Chat Completions,
Responses, Anthropic Messages), streamed and not, with reasoning, stop strings, a JSON
schema and a forced tool call (their grammars check each draft as it is kept), alone and
eight at once. The metrics must show the layer's drafts kept and more than one token per
target pass.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from replicas.builtin import script
from tests.e2e.test_features_http import SCHEMA as PROFILE_SCHEMA
from tests.e2e.test_openai_http import stream_chat
from tests.e2e.test_speculative_http import claude, oai
from tests.e2e.test_tools_http import UNIT_TOOL, calls_of
from tests.observability.test_observability_http import App, _total

pytestmark = pytest.mark.e2e
SOURCE = "builtin:mtp-agree"
PLAIN, FAST = "mla", "mla-mtp"
TOKENS = 40  # an untrained model writes until max_tokens
SCRIPTS = ("cities", "sum-think", "tea-steps", "unicode")
__all__ = ["claude", "oai"]  # the SDK clients' fixtures, over this module's `app`


# Served with the other modules' extra models by one app (conftest, `shared_app.py`): the
# metrics below are this module's models' own (by their `model` label).
MODELS: list[dict[str, Any]] = [
    {"id": PLAIN, "source": SOURCE},
    {"id": FAST, "source": SOURCE, "speculative": {"method": "mtp", "num_speculative_tokens": 3,
                                                   "disable_when_slower": False}}]


@pytest.fixture(scope="module")
def app(shared_app: App) -> App:
    return shared_app


def chat(sid: str, **extra: Any) -> dict[str, Any]:
    s = script(sid)
    args: dict[str, Any] = {"messages": s.message_dicts, "temperature": 0,
                            "max_tokens": TOKENS, **extra}
    if s.enable_thinking is not None:
        args["extra_body"] = {"chat_template_kwargs": {"enable_thinking": s.enable_thinking}}
    return args


def both(run: Any) -> tuple[Any, Any]:
    """`run(model)` for the plain model and the speculating one."""
    return run(PLAIN), run(FAST)


@pytest.mark.parametrize("sid", SCRIPTS)
def test_chat_is_the_output_without_speculation_streamed_or_not(oai: openai.OpenAI,
                                                                sid: str) -> None:
    def run(model: str) -> tuple[Any, ...]:
        full = oai.chat.completions.create(model=model, **chat(sid))
        message = full.choices[0].message
        return (message.content, getattr(message, "reasoning_content", None) or "",
                full.choices[0].finish_reason, full.usage.completion_tokens,
                stream_chat(oai, model=model, **chat(sid))[:2])

    plain, fast = both(run)
    assert fast == plain
    assert plain[0] and plain[4] == (plain[0], plain[1])


def test_stop_strings_cut_both_at_the_same_place(oai: openai.OpenAI) -> None:
    prompt = script("count-completion").prompt

    def run(model: str, **extra: Any) -> Any:
        return oai.completions.create(model=model, prompt=prompt, temperature=0,
                                      max_tokens=TOKENS, **extra).choices[0]

    text = run(PLAIN).text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # met half way
    plain, fast = both(lambda model: run(model, stop=[stop]))
    assert (fast.text, fast.finish_reason) == (plain.text, plain.finish_reason)
    assert plain.finish_reason == "stop" and len(plain.text) < len(text)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=FAST, prompt=prompt, temperature=0, max_tokens=TOKENS, stop=[stop], stream=True)
        if c.choices)
    assert streamed == plain.text


def test_responses_and_messages_are_the_output_without_speculation(
        oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    s = script("sum-think")
    messages = [m for m in s.message_dicts if m["role"] != "system"]

    def responses(model: str) -> tuple[str, str]:
        full = oai.responses.create(model=model, input=messages, max_output_tokens=TOKENS,
                                    temperature=0)
        streamed = "".join(e.delta for e in oai.responses.create(
            model=model, input=messages, max_output_tokens=TOKENS, temperature=0, stream=True)
            if e.type == "response.output_text.delta")
        return full.output_text, streamed

    def anthropic_text(model: str) -> tuple[str, str]:
        args: dict[str, Any] = {"model": model, "max_tokens": TOKENS, "messages": messages,
                                "extra_body": {"temperature": 0}}
        full = "".join(b.text for b in claude.messages.create(**args).content
                       if b.type == "text")
        with claude.messages.stream(**args) as stream:
            streamed = "".join(stream.text_stream)
        return full, streamed

    for run in (responses, anthropic_text):
        plain, fast = both(run)
        assert fast == plain and plain[0] == plain[1] and plain[0], (run.__name__, plain)


def test_a_json_schema_and_a_forced_call_are_the_output_without_speculation(
        oai: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PROFILE_SCHEMA,
                                                     "strict": True}}
    profile = chat("profile-prose", response_format=schema, max_tokens=200)
    plain, fast = both(lambda model: stream_chat(oai, model=model, **profile)[0])
    assert fast == plain
    jsonschema.validate(json.loads(plain), PROFILE_SCHEMA)
    unit = chat("tool-one", tools=[*script("tool-one").tool_dicts, UNIT_TOOL], max_tokens=200,
                tool_choice={"type": "function", "function": {"name": "get_unit"}})
    plain_calls, fast_calls = both(lambda model: calls_of(
        oai.chat.completions.create(model=model, **unit).choices[0].message))
    assert [name for name, _ in plain_calls] == ["get_unit"]
    assert [args for _, args in fast_calls] == [args for _, args in plain_calls]


def test_eight_concurrent_streams_are_each_the_output_alone(oai: openai.OpenAI,
                                                           app: App) -> None:
    jobs = [(sid, tokens) for sid in SCRIPTS for tokens in (TOKENS, TOKENS // 2)]
    alone = [stream_chat(oai, model=PLAIN, **chat(sid, max_tokens=n))[:2] for sid, n in jobs]

    async def together() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{app.serve.base_url}/v1", api_key="unused",
                                    max_retries=0, timeout=180)

        async def one(sid: str, n: int) -> tuple[str, str]:
            content, reasoning = [], []
            async for chunk in await client.chat.completions.create(
                    model=FAST, stream=True, **chat(sid, max_tokens=n)):
                if chunk.choices:
                    content.append(chunk.choices[0].delta.content or "")
                    reasoning.append(getattr(chunk.choices[0].delta, "reasoning_content",
                                             None) or "")
            return "".join(content), "".join(reasoning)

        try:
            return list(await asyncio.gather(*(one(sid, n) for sid, n in jobs)))
        finally:
            await client.close()

    assert asyncio.run(together()) == alone


def test_metrics_show_the_layers_drafts_kept_and_several_tokens_per_pass(app: App) -> None:
    """After the tests above (which ran first, in file order): the MTP model's drafts,
    kept nearly all, more than two tokens per target pass; the plain model speculates not."""
    names = ("orchard_spec_target_passes_total", "orchard_spec_output_tokens_total",
             "orchard_spec_draft_tokens_total", "orchard_spec_accepted_tokens_total")
    deadline = time.monotonic() + 120
    while True:
        text = app.scrape()
        passes, tokens, drafted, kept = (_total(text, n, model=FAST, method="mtp")
                                         for n in names)
        if passes and tokens > 2 * passes and kept >= 0.8 * drafted > 0:
            break
        assert time.monotonic() < deadline, (passes, tokens, drafted, kept)
        time.sleep(1)
    assert all(_total(text, n, model=PLAIN) == 0 for n in names)
