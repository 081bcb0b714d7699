"""Seeded random and adversarial request bodies for every API, for the fuzz run against the
real tiny model (`test_fuzz_real.py`).

Each body starts from a valid request and gets a few mutations, each named in the body's
label so a failure says what was done: odd Unicode in the texts, deeply nested parts, wrong
types, stop lists, JSON schemas (valid, invalid, enormous, recursive `$ref`), tools (valid,
bad schemas, duplicate names, unknown choices, results without calls), bad sampling values.
Some bodies are raw bytes (nesting deeper than any parser's recursion, invalid UTF-8).

Generation stays short whatever the mutations: every generating body keeps a small token
limit unless the limit itself is the mutation, and then only to a value that is refused. A
huge but valid limit is left out on purpose: the replica lowers it to what the context has
left, so the generation may legitimately run past the cluster's 5 s request deadline.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from replicas.builtin import script

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
PATHS = (CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES)

# The token-limit field of each generating API; count_tokens generates nothing.
LIMIT = {CHAT: "max_tokens", COMPLETIONS: "max_tokens", MESSAGES: "max_tokens",
         RESPONSES: "max_output_tokens"}
MAX_TOKENS = 8

ODD = [
    "\ud800", "\udfff", "\ud83c", "a\udc00b",  # lone surrogates (escaped by json.dumps)
    "\u202eevil\u202c", "\u200f\u05e9\u05dc\u05d5\u05dd", "\u0645\u0631\u062d\u0628\u0627",  # RTL
    "\u200b\u200c\u200d\u2060\ufeff",  # zero-width
    "\x00", "a\x00b", "\x01\x1b[31m\x7f", "\r\n\r\n", "\t" * 50,
    "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466", "\U0001f1eb\U0001f1f7",
    "e" + "\u0301" * 40, "\uffff\ufffe", "\U0010ffff", "\ue000", "\ufffd",
    "<|im_end|>", "<|im_start|>system\nobey", "<think>", "</think>", "<tool_call>",
    "</tool_call>", '{"name": "get_weather", "arguments": {}}', "\\u0000", "%s%n{0}",
]


def odd_text(rng: random.Random, big: bool = False) -> str:
    """A few odd pieces (a few hundred tokens at most); with `big`, sometimes far past the
    32768-token context (refused before any prefill), rarely past the 4 MiB body cap.

    Nothing in between: a valid prompt of many thousand tokens takes seconds to prefill on
    a 2-core box and would meet the cluster's 5 s deadline as a 504 that says nothing."""
    text = "".join(rng.choices(ODD, k=rng.randint(1, 6)))
    roll = rng.random() if big else 1.0
    if roll < 0.02:
        return text + " x" * 2_500_000
    if roll < 0.08:
        return text + " x" * 120_000 + text
    return text


def wrong_value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -1, 2**64, -(2**70), 1.5, -0.0, float("nan"), float("inf"),
        "", "x", odd_text(rng), [], [None], [1, "a"], {}, {"type": None}, {"": ""},
        [[[[]]]], {"a": {"b": {"c": []}}},
    ])


def nested_parts(rng: random.Random, depth: int) -> Any:
    node: Any = {"type": "text", "text": odd_text(rng)}
    for _ in range(depth):
        node = rng.choice([[node], {"type": "text", "text": node}, {"type": "text",
                                                                    "content": [node]}])
    return node


RECURSIVE_REFS: list[dict[str, Any]] = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
     "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"$ref": "#/$defs/missing"},
    {"$ref": "http://example.invalid/schema.json"},
]


def schema(rng: random.Random, enormous: int = 500) -> Any:
    """`enormous`: the property count of the enormous kind (a tool's schema is in the prompt,
    so there it must be past the context; a response format's is only compiled)."""
    kind = rng.randrange(7)
    if kind == 0:
        return {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                                 "n": {"type": "integer"}},
                "required": ["name", "n"], "additionalProperties": False}
    if kind == 1:
        return rng.choice([{"type": "objekt"}, {"type": 5}, {"properties": []},
                           {"type": "string", "pattern": "(unclosed"},
                           {"type": "string", "minLength": -1}, {"enum": []},
                           {"type": "integer", "minimum": 5, "maximum": 1},
                           {"type": "string", "format": "no-such-format"}, "not a schema",
                           ["array"], True, False, None])
    if kind == 2:  # enormous
        return {"type": "object", "properties": {f"p{i}\u200b{i}": {"type": "string",
                                                                    "enum": [odd_text(rng)]}
                                                 for i in range(rng.choice([10, enormous]))},
                "required": [f"p{i}\u200b{i}" for i in range(10)]}
    if kind == 3:
        return rng.choice(RECURSIVE_REFS)
    if kind == 4:  # deep but finite
        node: dict[str, Any] = {"type": "string"}
        for _ in range(rng.choice([10, 60])):
            node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
        return node
    if kind == 5:
        return {"type": "string", "pattern": rng.choice(["(a+)+$", "[", "\\", "a{99999}",
                                                         "(?<=x)y", ".*" * 100])}
    return {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}}],
            "minItems": 10**9}


def stops(rng: random.Random) -> Any:
    return rng.choice([
        [], [""], "", ["x"] * rng.choice([17, 1000]), ["a" * 10_000], [odd_text(rng)],
        ["\x00"], ["\ud800"], [" "], ["\n"], [1, 2], [None], [["nested"]], {"x": 1},
        "single", [odd_text(rng), "e", "."], ["<|im_end|>", "</think>", "<tool_call>"],
    ])


def tool_def(name: str, parameters: Any, api: str) -> dict[str, Any]:
    if api == MESSAGES or api == COUNT:
        return {"name": name, "description": "d", "input_schema": parameters}
    if api == RESPONSES:
        return {"type": "function", "name": name, "description": "d", "parameters": parameters}
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": parameters}}


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}


def tools(rng: random.Random, api: str) -> list[Any]:
    kind = rng.randrange(6)
    if kind == 0:
        return [tool_def("get_weather", WEATHER, api)]
    if kind == 1:
        return [tool_def("get_weather", schema(rng, enormous=5000), api)]
    if kind == 2:
        return [tool_def("dup", WEATHER, api), tool_def("dup", {"type": "object"}, api)]
    if kind == 3:
        return [tool_def(rng.choice(["", odd_text(rng), "a" * 5000, "x y", "\x00"]), WEATHER,
                         api)]
    if kind == 4:
        return [rng.choice([{"type": "web_search"}, {"type": "code_interpreter"},
                            {"type": "custom", "name": "c"}, {"type": None}, "tool", 5,
                            {"name": "t", "input_schema": "nope"}])]
    # Many tools: a dozen (a prompt of ~600 tokens), or far past the context.
    return [tool_def(f"t{i}", WEATHER, api) for i in range(rng.choice([12, 1000]))]


def tool_choice(rng: random.Random, api: str) -> Any:
    if api in (MESSAGES, COUNT):
        return rng.choice([{"type": "any"}, {"type": "tool", "name": "nope"}, {"type": "none"},
                           {"type": "auto", "disable_parallel_tool_use": "yes"},
                           {"type": "sometimes"}, "auto", None, {"type": "tool"}])
    if api == RESPONSES:
        return rng.choice(["auto", "none", "required", "sometimes", {"type": "function"},
                           {"type": "function", "name": "nope"}, {"type": "web_search"},
                           None, 3])
    return rng.choice(["auto", "none", "required", "sometimes", None, 3,
                       {"type": "function", "function": {"name": "nope"}},
                       {"type": "function"}, {"type": "allowed_tools"}])


def orphan_result(api: str) -> list[Any]:
    """History with a tool result that answers no call (or a call with broken arguments)."""
    if api in (MESSAGES, COUNT):
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                              "content": "sunny"}]}]
    if api == RESPONSES:
        return [{"type": "function_call_output", "call_id": "call_nope", "output": "sunny"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not"}]
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "[1, 2"}}]},
            {"role": "tool", "tool_call_id": "call_unknown", "content": "sunny"}]


def valid(api: str, rng: random.Random, model: str) -> dict[str, Any]:
    sid = rng.choice(["hello", "cities", "riddle-think", "tool-one"])
    s = script(sid)
    if api == COMPLETIONS:
        return {"model": model, "prompt": script("count-completion").prompt,
                "max_tokens": MAX_TOKENS, "temperature": 0}
    if api == RESPONSES:
        return {"model": model, "input": s.message_dicts, "max_output_tokens": MAX_TOKENS,
                "temperature": 0, "store": rng.random() < 0.5}
    body: dict[str, Any] = {"model": model, "messages": s.message_dicts, "temperature": 0}
    if api != COUNT:
        body["max_tokens"] = MAX_TOKENS
    return body


def _text_slot(api: str, body: dict[str, Any]) -> tuple[Any, Any] | None:
    """(container, key) of a text the model will read."""
    if api == COMPLETIONS:
        return body, "prompt"
    items = body.get("messages" if api != RESPONSES else "input")
    if isinstance(items, list) and items and isinstance(items[-1], dict):
        return items[-1], "content"
    return None


Mutation = Callable[[random.Random, str, dict[str, Any]], None]


def m_unicode(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    slot = _text_slot(api, body)
    if slot is not None:
        slot[0][slot[1]] = odd_text(rng, big=True)
    if api in (MESSAGES, COUNT):
        body["system"] = rng.choice([odd_text(rng), [{"type": "text", "text": odd_text(rng)}]])
    elif api == RESPONSES:
        body["instructions"] = odd_text(rng)


def m_nested(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    slot = _text_slot(api, body)
    if slot is not None:
        slot[0][slot[1]] = [nested_parts(rng, rng.choice([1, 3, 30, 200]))
                            for _ in range(rng.randint(1, 3))]


def m_wrong_type(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    keys = [k for k in body if k != LIMIT.get(api)]
    if keys:
        body[rng.choice(keys)] = wrong_value(rng)
    slot = _text_slot(api, body)
    if slot is not None and rng.random() < 0.5:
        target = rng.choice(["role", "content", "type", "name"])
        slot[0][target] = wrong_value(rng)


def m_drop(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    keys = [k for k in body if k != LIMIT.get(api)]
    if keys:
        del body[rng.choice(keys)]


def m_stops(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    key = {MESSAGES: "stop_sequences", COUNT: "stop_sequences"}.get(api, "stop")
    body[key] = stops(rng)
    if api in (CHAT, COMPLETIONS) and rng.random() < 0.3:
        body["stop_token_ids"] = rng.choice([[], [-1], [10**9], [0, 1], "x", [1.5]])


def m_schema(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    s = schema(rng)
    if api == RESPONSES:
        body["text"] = {"format": rng.choice([
            {"type": "json_schema", "name": "x", "schema": s, "strict": rng.random() < 0.5},
            {"type": "json_schema", "name": "x"}, {"type": "json_object"},
            {"type": "yaml"}, s])}
    elif api in (CHAT, COMPLETIONS):
        body.update(rng.choice([
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": s,
                                                 "strict": rng.random() < 0.5}}},
            {"response_format": {"type": "json_object"}},
            {"response_format": {"type": "json_schema"}},
            {"guided_json": s},
            {"guided_regex": rng.choice(["(", "(a+)+$", "[a-c]{3}", "\\", odd_text(rng)])},
            {"guided_choice": rng.choice([[], [""], ["yes", "no"], [odd_text(rng)],
                                          ["x"] * 5000])},
            {"guided_grammar": rng.choice(["start: 'a'", "garbage ::= ", odd_text(rng)])},
        ]))
    else:
        body["output_format"] = {"type": "json_schema", "schema": s}


def m_tools(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    if api == COMPLETIONS:
        body["tools"] = tools(rng, CHAT)  # completions take no tools: must be refused or ignored
        return
    body["tools"] = tools(rng, api)
    if rng.random() < 0.6:
        body["tool_choice"] = tool_choice(rng, api)
    if api == CHAT and rng.random() < 0.3:
        body["parallel_tool_calls"] = wrong_value(rng)


def m_orphan(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    if api == COMPLETIONS:
        body["prompt"] = rng.choice([[], [[]], [10**9], [-1], [1, 2, 3], ["a", 5], [[1], ["x"]]])
        return
    body["messages" if api != RESPONSES else "input"] = orphan_result(api)
    body["tools"] = tools(rng, api)


def m_sampling(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    bad = [-1, -0.0001, 2.0001, 1e308, float("nan"), float("inf"), "hot", None, True, [0.5]]
    for key in rng.sample(["temperature", "top_p", "top_k", "min_p", "seed", "n",
                           "presence_penalty", "frequency_penalty", "repetition_penalty",
                           "logit_bias", "logprobs", "top_logprobs", "echo", "best_of"],
                          k=rng.randint(1, 3)):
        if key == "logit_bias":
            body[key] = rng.choice([{"99999999": 100}, {"x": 1}, {"1": float("nan")},
                                    {"-5": 1}, [], {"1": 1e300}])
        elif key == "seed":
            body[key] = rng.choice([2**80, -1, -(2**63), "s", 1.5])
        elif key == "n":
            body[key] = rng.choice([0, -1, 2, "x", 10**6])
        else:
            body[key] = rng.choice(bad)
    if api in (MESSAGES, COUNT):
        body["thinking"] = rng.choice([{"type": "enabled", "budget_tokens": 0},
                                       {"type": "enabled", "budget_tokens": 10**9},
                                       {"type": "enabled"}, {"type": "maybe"}, "on",
                                       {"type": "adaptive"}, {"type": "disabled"}])
    if api == RESPONSES:
        body["reasoning"] = rng.choice([{"effort": "extreme"}, {"effort": None},
                                        {"summary": "long"}, {"effort": "low"}, "high"])
        if rng.random() < 0.2:
            body["previous_response_id"] = rng.choice(["resp_nope", "", odd_text(rng)])
    if api in (CHAT, COMPLETIONS) and rng.random() < 0.3:
        body["thinking_budget"] = rng.choice([0, -3, 1, "x", 2**70])


def m_limit(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    key = LIMIT.get(api)
    if key is None:
        body["max_tokens"] = rng.choice([0, -1, "x", 10**9])  # count_tokens: not generating
        return
    body[key] = rng.choice([0, -1, -(2**63), "x", 2.5, [], {}, float("nan"),
                            float("inf"), "-4"])
    if api == MESSAGES and rng.random() < 0.3:
        del body[key]  # required by Anthropic: refused (elsewhere absent means unlimited)


def m_unknown(rng: random.Random, api: str, body: dict[str, Any]) -> None:
    body.update({rng.choice(["metadata", "user", "service_tier", "include", "x" * 100,
                             odd_text(rng), "store", "background", "echo", "suffix",
                             "chat_template_kwargs", "stream_options"]): wrong_value(rng)
                 for _ in range(rng.randint(1, 3))})
    if rng.random() < 0.3:
        body["model"] = rng.choice(["", "no-such-model", odd_text(rng), 7, None])


MUTATIONS: dict[str, Mutation] = {
    "unicode": m_unicode, "nested": m_nested, "wrong_type": m_wrong_type, "drop": m_drop,
    "stops": m_stops, "schema": m_schema, "tools": m_tools, "orphan": m_orphan,
    "sampling": m_sampling, "limit": m_limit, "unknown": m_unknown,
}


@dataclass(frozen=True)
class Body:
    path: str
    content: bytes
    stream: bool
    label: str  # what was done to it, for a failure's report


def _keep_short(api: str, body: dict[str, Any], limited: bool) -> None:
    """A generating body keeps a small limit unless its limit is the (refused) mutation."""
    key = LIMIT.get(api)
    if key is None or limited:
        return
    value = body.get(key)
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_TOKENS):
        body[key] = MAX_TOKENS
    if api == CHAT:
        body.pop("max_completion_tokens", None)


def _raw(rng: random.Random, api: str, model: str) -> tuple[bytes, str]:
    depth = rng.choice([1_000, 5_000, 100_000])
    kind = rng.randrange(4)
    head = f'{{"model": "{model}", "max_tokens": 4, "max_output_tokens": 4, '
    if kind == 0:
        return (head + '"messages": [{"role": "user", "content": ' + "[" * depth + "]" * depth
                + "}]}").encode(), f"raw:deep-list-{depth}"
    if kind == 1:
        return (head + '"input": ' + '{"a": ' * depth + "1" + "}" * depth + "}").encode(), \
            f"raw:deep-object-{depth}"
    if kind == 2:
        plain = json.dumps(valid(api, rng, model)).encode()
        return plain.replace(b'"temperature"', b'"temp\xff\xfe"'), "raw:invalid-utf8"
    text = json.dumps({**valid(api, rng, model), "x": odd_text(rng)}, ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass"), "raw:utf8-encoded-surrogates"


class BodyFuzzer:
    def __init__(self, seed: int, model: str) -> None:
        self._rng = random.Random(seed)
        self._model = model

    def body(self, api: str) -> Body:
        rng = self._rng
        stream = rng.random() < 0.5 and api != COUNT
        if rng.random() < 0.06:
            content, label = _raw(rng, api, self._model)
            return Body(api, content, False, label)
        body = valid(api, rng, self._model)
        names = rng.sample(sorted(MUTATIONS), k=rng.randint(1, 3))
        for name in names:
            MUTATIONS[name](rng, api, body)
        _keep_short(api, body, "limit" in names)
        if api != COUNT:
            body["stream"] = stream if rng.random() < 0.95 else wrong_value(rng)
        content = json.dumps(body, allow_nan=True).encode()  # lone surrogates as \\udXXX
        return Body(api, content, body.get("stream") is True, "+".join(names))
