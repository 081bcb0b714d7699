"""Every tool format over HTTP: each has a built-in model (`builtin:fmt-<format>`) whose
chat template and vocabulary are a real family's, Orchard detects the format from those
files, and forced calls come back through the official `openai` and `anthropic` SDKs in
all three APIs, streamed and not, then go back in the history with their result.

The weights are random, so each call is forced (`tool_choice` naming `set_mode`, whose
parameters are single-value enums: the grammar fixes every byte but optional JSON blanks)
with parallel calls off. One `serve run` serves every format's model (the two-hop layout
of several models): the package's shared app (conftest), beside other modules' models. A format in `TOOL_FORMATS` without a built-in model fails here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from replicas.builtin import BUILTIN_NAMES, ensure_builtin, family_model_name
from replicas.builtin.family_models import FAMILY_MODELS, SAMPLE_TOOLS, tool_markers
from replicas.families.registry import TOOL_FORMATS, detect_tool_format
from tests.observability.test_observability_http import App

pytestmark = pytest.mark.e2e

FORMATS = [name for name in TOOL_FORMATS if name != "none"]

# The forced tool and a decoy: the call must name set_mode and say exactly this.
FORCED = "set_mode"
EXPECTED = {"mode": "dark", "level": "high"}
CHAT_TOOLS = [dict(t) for t in SAMPLE_TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"], "strict": False}
                   for t in CHAT_TOOLS]
QUESTION = "Set the display mode to dark, level high."
RESULT = '{"ok": true}'
MAX_TOKENS = 200


def model_for(fmt: str) -> str:
    """The format's built-in model, or a failure naming the format that has none."""
    name = family_model_name(fmt)
    if name not in BUILTIN_NAMES:
        pytest.fail(f"tool format {fmt!r} has no built-in model {name!r} (its family's "
                    "test template, replicas/families/)")
    return name


def markers(fmt: str) -> tuple[str, ...]:
    """What must never reach the text: the format's markers and the model's added tokens."""
    _, family = FAMILY_MODELS[family_model_name(fmt)]
    return tuple(dict.fromkeys((*tool_markers(fmt), *family.template.added)))


def no_markers(fmt: str, text: str | None) -> None:
    leaked = [m for m in markers(fmt) if m in (text or "")]
    assert not leaked, (fmt, leaked, text)


# Every format's model, served with the other modules' extra models by one app (conftest,
# `shared_app.py`): each test talks to its format's model only, by id.
SERVED = [family_model_name(f) for f in FORMATS if family_model_name(f) in BUILTIN_NAMES]
MODELS: list[dict[str, Any]] = [{"id": name, "source": f"builtin:{name}", "num_replicas": 1,
                                 "max_ongoing_requests": 16} for name in SERVED]


@pytest.fixture(scope="module")
def base_url(shared_app: App) -> str:
    assert SERVED, "no family model to serve"
    return shared_app.serve.base_url


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


# ---- detection ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_format_is_detected_from_the_models_files(fmt: str) -> None:
    # What the replica does at start (replicas/replica.py): its template and vocabulary.
    tokenizer = load_tokenizer(ensure_builtin(model_for(fmt)))._tokenizer
    assert detect_tool_format(tokenizer.chat_template, tokenizer.get_vocab().keys()) == fmt
    grammar = TOOL_FORMATS[fmt].grammar
    assert grammar is not None
    for marker in grammar.markers:  # the family's special tokens are tokens here too
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker


# ---- OpenAI chat completions ----------------------------------------------------------------


def chat_args(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "tools": CHAT_TOOLS, "temperature": 0,
            "max_tokens": MAX_TOKENS, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": FORCED}}}


def the_forced_call(fmt: str, finished: bool, reply: Any, text: str | None, calls: Any,
                    read: Callable[[Any], tuple[str, Any]]) -> Any:
    """The one call of a reply that ended for it (`finished`), with no text: `read` gives
    its name and arguments, which must be the forced tool's and the expected ones."""
    assert finished, reply
    assert not text, text
    no_markers(fmt, text)
    (call,) = calls
    assert read(call) == (FORCED, EXPECTED)
    return call


def again_with_history(create: Callable[..., Any], args: dict[str, Any]) -> Any:
    """The request with the call and its result in the history: accepted, its reply."""
    again = create(**args)
    assert again.status_code == 200
    return again.parse()


def check_chat_call(fmt: str, choice: Any) -> Any:
    return the_forced_call(fmt, choice.finish_reason == "tool_calls", choice,
                           choice.message.content, choice.message.tool_calls,
                           lambda c: (c.function.name, json.loads(c.function.arguments)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_chat_forced_call_streamed_or_not_and_its_round_trip(
        oai: openai.OpenAI, fmt: str) -> None:
    model = model_for(fmt)
    question = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(**chat_args(model, question))
    call = check_chat_call(fmt, whole.choices[0])

    with oai.chat.completions.stream(**chat_args(model, question)) as stream:
        names: list[str] = []
        pieces: list[str] = []
        text: list[str] = []
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            delta = event.chunk.choices[0].delta
            text.append(delta.content or "")
            for piece in delta.tool_calls or []:
                assert piece.index == 0
                if piece.function and piece.function.name:
                    names.append(piece.function.name)
                pieces.append((piece.function.arguments if piece.function else None) or "")
        final = stream.get_final_completion()
    streamed = check_chat_call(fmt, final.choices[0])
    assert names == [FORCED] and "".join(pieces) == streamed.function.arguments
    no_markers(fmt, "".join(text))

    # The call and its result back in the history: the template renders both.
    history = [*question,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name,
                                 "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    again = again_with_history(oai.chat.completions.with_raw_response.create,
                               chat_args(model, history))
    check_chat_call(fmt, again.choices[0])


# ---- Anthropic messages ---------------------------------------------------------------------


def anthropic_args(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "tools": ANTHROPIC_TOOLS,
            "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0},
            "tool_choice": {"type": "tool", "name": FORCED, "disable_parallel_tool_use": True}}


def check_tool_use(fmt: str, message: Any) -> Any:
    return the_forced_call(fmt, message.stop_reason == "tool_use", message,
                           "".join(b.text for b in message.content if b.type == "text"),
                           [b for b in message.content if b.type == "tool_use"],
                           lambda u: (u.name, u.input))


@pytest.mark.parametrize("fmt", FORMATS)
def test_anthropic_forced_tool_use_streamed_or_not_and_its_round_trip(
        claude: anthropic.Anthropic, fmt: str) -> None:
    model = model_for(fmt)
    question = [{"role": "user", "content": QUESTION}]
    use = check_tool_use(fmt, claude.messages.create(**anthropic_args(model, question)))

    partial: list[str] = []
    text: list[str] = []
    with claude.messages.stream(**anthropic_args(model, question)) as stream:
        for event in stream:
            if event.type == "content_block_start" and event.content_block.type == "tool_use":
                assert event.content_block.name == FORCED
            elif event.type == "content_block_delta":
                if event.delta.type == "input_json_delta":
                    partial.append(event.delta.partial_json)
                elif event.delta.type == "text_delta":
                    text.append(event.delta.text)
        final = stream.get_final_message()
    streamed = check_tool_use(fmt, final)
    assert json.loads("".join(partial)) == streamed.input == EXPECTED
    no_markers(fmt, "".join(text))

    history = [*question,
               {"role": "assistant", "content": [
                   {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    check_tool_use(fmt, again_with_history(claude.messages.with_raw_response.create,
                                           anthropic_args(model, history)))


# ---- OpenAI Responses -----------------------------------------------------------------------


def responses_args(model: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "input": items, "tools": RESPONSES_TOOLS, "temperature": 0,
            "max_output_tokens": MAX_TOKENS, "parallel_tool_calls": False, "store": False,
            "tool_choice": {"type": "function", "name": FORCED}}


def check_function_call(fmt: str, response: Any) -> Any:
    return the_forced_call(fmt, response.status == "completed", response, response.output_text,
                           [i for i in response.output if i.type == "function_call"],
                           lambda c: (c.name, json.loads(c.arguments)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_responses_forced_function_call_streamed_or_not_and_its_round_trip(
        oai: openai.OpenAI, fmt: str) -> None:
    model = model_for(fmt)
    question = [{"role": "user", "content": QUESTION}]
    call = check_function_call(fmt, oai.responses.create(**responses_args(model, question)))

    with oai.responses.stream(**responses_args(model, question)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = check_function_call(fmt, final)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == streamed.arguments
    no_markers(fmt, "".join(e.delta for e in events if e.type == "response.output_text.delta"))

    history = [*question,
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    check_function_call(fmt, again_with_history(oai.responses.with_raw_response.create,
                                                responses_args(model, history)))
