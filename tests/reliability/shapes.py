"""Is a reply in its API's shape? For the fuzzers (`test_fuzz_http.py` in-process,
`test_fuzz_real.py` against the real model): one answer to "what is wrong with this body".

A success body must validate as the official SDK's model of that API's object (the class
the SDK parses it into), not merely carry the right `object` field; a stream must be SSE
whose every event validates as the SDK's event of its `type` (its `event:` name the same
where the API names events), ending its API's normal way. Errors are each API's error
shape. A stream that ends with an error of the client's making (a schema the grammar
compiler refuses once the stream began) is the client's fault, and said so.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import anthropic.types as anthropic_types
import pydantic
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from tests.reliability.wire import parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
MODELS = "/v1/models"

# Errors a stream may end with that are the client's doing; anything else there is the
# server's fault.
CLIENT_TYPES = {"invalid_request_error", "not_found_error"}

SUCCESS: dict[str, type[pydantic.BaseModel]] = {
    CHAT: ChatCompletion, COMPLETIONS: Completion, MESSAGES: anthropic_types.Message,
    COUNT: anthropic_types.MessageTokensCount, RESPONSES: Response,
}


def _by_type(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    """The SDK's event classes of a (discriminated) union, by their `type` literal."""
    members = typing.get_args(typing.get_args(union)[0]) or typing.get_args(union)
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in members}


RESPONSE_EVENTS = _by_type(ResponseStreamEvent)
MESSAGE_EVENTS = _by_type(anthropic_types.RawMessageStreamEvent)


def _invalid(cls: type[pydantic.BaseModel], data: Any) -> str | None:
    try:
        cls.model_validate(data)
    except pydantic.ValidationError as exc:
        return f"not a valid {cls.__name__}: {exc.errors()[:3]}"
    return None


def _error_shape_ok(path: str, data: Any) -> bool:
    if path.startswith(MESSAGES):
        return (isinstance(data, dict) and data.get("type") == "error"
                and isinstance(data.get("error"), dict)
                and isinstance(data["error"].get("type"), str)
                and isinstance(data["error"].get("message"), str))
    return (isinstance(data, dict) and isinstance(data.get("error"), dict)
            and isinstance(data["error"].get("type"), str)
            and isinstance(data["error"].get("message"), str) and bool(data["error"]["message"]))


def _unscored_first(data: Any) -> Any:
    """A completion with `echo`: its prompt's first token has null logprobs, as OpenAI's
    API sends them (nothing predicts it), though the SDK's type says float. Checked as
    null there and nowhere else, then the rest against the SDK's type."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return data
    choices = []
    for choice in data["choices"]:
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(lp, dict) and lp.get("token_logprobs") and lp["token_logprobs"][0] is None:
            lp = {**lp, "token_logprobs": [0.0, *lp["token_logprobs"][1:]],
                  "top_logprobs": [{}, *(lp.get("top_logprobs") or [None])[1:]]}
            choice = {**choice, "logprobs": lp}
        choices.append(choice)
    return {**data, "choices": choices}


def shape_problem(path: str, status: int, data: Any) -> str | None:
    """What is wrong with a non-streamed reply's JSON, or None."""
    if status >= 400:
        return None if _error_shape_ok(path, data) else "error body not in the API's error shape"
    if not 200 <= status < 300:
        return f"HTTP {status}: neither a success nor an error"
    if path == MODELS:
        if not (isinstance(data, dict) and data.get("object") == "list"
                and isinstance(data.get("data"), list) and data["data"]):
            return "model list not in its shape"
        return next(filter(None, (_invalid(Model, m) for m in data["data"])), None)
    if path not in SUCCESS:
        return None  # no API object to check (/health)
    problem = _invalid(SUCCESS[path], _unscored_first(data) if path == COMPLETIONS else data)
    if problem is None and path == RESPONSES and data["status"] not in ("completed",
                                                                        "incomplete"):
        problem = f"a whole response with status {data['status']!r}"
    return problem


def _event_problem(path: str, name: str | None, data: Any) -> str | None:
    """What is wrong with one SSE event that is not an error, or None."""
    if path in (CHAT, COMPLETIONS):
        if data == "[DONE]":
            return None
        if path == CHAT:
            return _invalid(ChatCompletionChunk, data)
        # The SDK's Completion says finish_reason is always set; a streamed chunk before
        # the last has it null (as OpenAI's own stream does): check the rest as is.
        chunk = {**data, "choices": [{**c, "finish_reason": c.get("finish_reason") or "stop"}
                                     for c in data.get("choices", [])]}
        return _invalid(Completion, _unscored_first(chunk))
    kind = data.get("type") if isinstance(data, dict) else None
    if name != kind:
        return f"event name {name!r} is not its data's type {kind!r}"
    if path == MESSAGES and kind == "ping":
        return None
    classes = MESSAGE_EVENTS if path == MESSAGES else RESPONSE_EVENTS
    if kind not in classes:
        return f"unknown event type {kind!r}"
    return _invalid(classes[kind], data)


def stream_problem(path: str, text: str) -> tuple[str | None, bool]:
    """(what is wrong with a 200 stream, or None; whether it ended with a client error)."""
    try:
        events = parse_sse(text)
    except (json.JSONDecodeError, ValueError) as exc:
        return f"unparsable SSE: {exc}", False
    for name, data in events:
        if path == RESPONSES and name == "response.failed":
            return f"response.failed: {data['response']['error']}", False
        error = None
        if name == "error" or (isinstance(data, dict) and "error" in data and name is None):
            error = data["error"]
        if error is not None:
            kind = error.get("type") if isinstance(error, dict) else None
            if kind in CLIENT_TYPES:
                return None, True
            return f"stream ended with a server error: {error}", False
        problem = _event_problem(path, name, data)
        if problem is not None:
            return f"{name or 'data'} event: {problem}", False
    ends = {MESSAGES: lambda n, d: n == "message_stop",
            RESPONSES: lambda n, d: n in ("response.completed", "response.incomplete")}
    ended = ends.get(path, lambda n, d: d == "[DONE]")
    if not any(ended(n, d) for n, d in events):
        return "stream stopped short of its normal end", False
    return None, False
