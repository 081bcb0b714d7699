"""OpenAI logprobs and `n` shapes: chat `logprobs.content`, completions' parallel lists,
streamed and not, and n choices merged by index (the real app, a scripted client)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    Usage,
    merge_deltas,
)
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.request import Generated
from replicas.pipeline.logprob_trail import LogprobTrail, TokenPieces
from tests.fakes import FakeClient

USAGE = Usage(prompt_tokens=5, completion_tokens=3)
HEL = TokenLogprob("Hel", 10, -0.25, (("Hel", -0.25), ("He", -1.5)))
LO = TokenLogprob("lo", 11, -0.5, (("lo", -0.5), ("p", -2.0)))
BANG = TokenLogprob("é", 12, -3.0, (("?", -0.1), ("é", -3.0)))
SCRIPT: list[OutputEvent] = [
    TextDelta(Channel.REASONING, "hmm", (TokenLogprob("hmm", 9, -0.1),)),
    TextDelta(Channel.ANSWER, "Hello", (HEL, LO)),
    TextDelta(Channel.ANSWER, "", (BANG,)),  # a held token's entry, flushed at the end
    Finished(FinishReason.EOS, USAGE),
]
CHAT = {"model": "orchard-tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "orchard-tiny", "prompt": "Say"}


def http(script: Any = SCRIPT) -> tuple[TestClient, FakeClient]:
    fake = FakeClient(script)
    return TestClient(create_app(fake)), fake


def chunks(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat_entry(e: TokenLogprob) -> dict[str, Any]:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                             for t, lp in e.top]}


def test_chat_body_has_the_answer_tokens_in_openai_shape() -> None:
    client, fake = http()
    body = client.post("/v1/chat/completions",
                       json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    assert fake.requests[0].sampling.logprobs == 2
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hello"
    # reasoning tokens are not content: only the answer's three tokens
    assert choice["logprobs"] == {"content": [chat_entry(e) for e in (HEL, LO, BANG)],
                                  "refusal": None}
    assert choice["logprobs"]["content"][2]["bytes"] == [0xC3, 0xA9]


def test_chat_stream_carries_each_chunks_tokens() -> None:
    client, _ = http()
    got = chunks(client.post("/v1/chat/completions",
                             json={**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True}))
    streamed = [e for c in got for ch in c["choices"] if ch["logprobs"]
                for e in ch["logprobs"]["content"]]
    assert streamed == [chat_entry(e) for e in (HEL, LO, BANG)]
    hello = next(c for c in got if c["choices"][0]["delta"].get("content") == "Hello")
    assert [e["token"] for e in hello["choices"][0]["logprobs"]["content"]] == ["Hel", "lo"]
    assert got[-1]["choices"][0]["logprobs"] is None  # the finish chunk


def test_chat_without_logprobs_reports_null() -> None:
    client, fake = http()
    body = client.post("/v1/chat/completions", json=CHAT).json()
    assert fake.requests[0].sampling.logprobs is None
    assert body["choices"][0]["logprobs"] is None


def test_chat_logprobs_true_alone_asks_for_no_alternatives() -> None:
    client, fake = http()
    client.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert fake.requests[0].sampling.logprobs == 0


def expected_completion(entries: list[TokenLogprob]) -> dict[str, Any]:
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def test_completion_logprobs_body_and_stream_agree() -> None:
    script = [TextDelta(Channel.ANSWER, "Hello", (HEL, LO)),
              TextDelta(Channel.ANSWER, "é", (BANG,)), Finished(FinishReason.LENGTH, USAGE)]
    client, fake = http(script)
    body = client.post("/v1/completions", json={**COMPLETION, "logprobs": 2}).json()
    assert fake.requests[0].sampling.logprobs == 2
    assert body["choices"][0]["logprobs"] == expected_completion([HEL, LO, BANG])
    got = chunks(client.post("/v1/completions",
                             json={**COMPLETION, "logprobs": 2, "stream": True}))
    pieces = [c["choices"][0]["logprobs"] for c in got if c["choices"][0]["logprobs"]]
    assert pieces == [expected_completion([HEL, LO]),
                      {**expected_completion([BANG]), "text_offset": [5]}]


def test_completion_top_always_holds_the_sampled_token() -> None:
    odd = TokenLogprob("x", 3, -4.0, (("a", -0.1),))
    client, _ = http([TextDelta(Channel.ANSWER, "x", (odd,)), Finished(FinishReason.EOS, USAGE)])
    body = client.post("/v1/completions", json={**COMPLETION, "logprobs": 1}).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1, "x": -4.0}]


def test_completion_echo_puts_the_prompt_first_its_first_token_unscored() -> None:
    """The replica sends the prompt as the first text; its first token has no logprob
    (null in both lists, as OpenAI), and the SDK's own model reads the body."""
    from tests.reliability.shapes import COMPLETIONS, shape_problem

    first = TokenLogprob("Say", 7, None)
    script = [TextDelta(Channel.ANSWER, "Say", (first,)),
              TextDelta(Channel.ANSWER, "Hello", (HEL, LO)), Finished(FinishReason.LENGTH, USAGE)]
    client, fake = http(script)
    body = client.post("/v1/completions", json={**COMPLETION, "logprobs": 1, "echo": True}).json()
    assert fake.requests[0].echo and fake.requests[0].sampling.logprobs == 1
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "SayHello"
    assert lp["tokens"] == ["Say", "Hel", "lo"] and lp["text_offset"] == [0, 3, 6]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert shape_problem(COMPLETIONS, 200, body) is None  # the SDK's type, the first null
    got = chunks(client.post("/v1/completions", json={**COMPLETION, "logprobs": 1, "echo": True,
                                                       "stream": True}))
    assert [t for c in got for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])] == \
        lp["tokens"]
    plain = client.post("/v1/completions", json=COMPLETION)
    assert plain.status_code == 200 and not fake.requests[-1].echo


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 1}, "top_logprobs"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"n": 9}, "n"),
])
def test_out_of_range_is_a_400_in_openai_shape(path: str, extra: dict[str, Any],
                                               param: str) -> None:
    client, fake = http()
    base = CHAT if "chat" in path else COMPLETION
    r = client.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"]
    assert fake.requests == []


def per_choice(request: GenerationRequest) -> list[OutputEvent]:
    """Each choice says its own index (from its request id) and uses i + 1 tokens."""
    i = int(request.request_id.rsplit("-", 1)[1])
    return [TextDelta(Channel.ANSWER, f"choice{i}"), TextDelta(Channel.ANSWER, "!"),
            Finished(FinishReason.EOS, Usage(5, i + 1, cached_tokens=2))]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_body(path: str) -> None:
    client, fake = http(per_choice)
    base = CHAT if "chat" in path else COMPLETION
    body = client.post(path, json={**base, "n": 3}).json()
    assert len(fake.requests) == 3
    assert len({r.request_id for r in fake.requests}) == 3
    texts = [c["message"]["content"] if "chat" in path else c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert texts == ["choice0!", "choice1!", "choice2!"]
    assert body["usage"]["prompt_tokens"] == 5  # once
    assert body["usage"]["completion_tokens"] == 1 + 2 + 3  # summed
    assert body["usage"]["total_tokens"] == 11


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_stream_interleave_by_index(path: str) -> None:
    client, _ = http(per_choice)
    base = CHAT if "chat" in path else COMPLETION
    got = chunks(client.post(path, json={**base, "n": 3, "stream": True,
                                         "stream_options": {"include_usage": True}}))
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in got[:-1]:
        (choice,) = chunk["choices"]
        piece = choice["delta"].get("content") if "chat" in path else choice["text"]
        text[choice["index"]] += piece or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert text == {0: "choice0!", 1: "choice1!", 2: "choice2!"}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("prompt", [["a", "bb"], [[1], [2, 3]]])
def test_several_prompts_are_choices_in_prompt_order(prompt: list[Any]) -> None:
    """Evaluation harnesses batch prompts: choice i is prompt i // n's generation i % n,
    and usage counts each prompt once."""
    client, fake = http(per_choice)
    body = client.post("/v1/completions", json={**COMPLETION, "prompt": prompt, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    want = [TextPrompt(p) if isinstance(p, str) else TokenPrompt(tuple(p)) for p in prompt]
    by_choice = {int(r.request_id.rsplit("-", 1)[1]): r.prompt for r in fake.requests}
    assert [by_choice[i] for i in range(4)] == [want[0], want[0], want[1], want[1]]
    assert body["usage"]["prompt_tokens"] == 2 * 5  # each prompt once
    assert body["usage"]["completion_tokens"] == 1 + 2 + 3 + 4


def test_too_many_prompts_is_a_400() -> None:
    client, fake = http()
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": ["x"] * 33, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert fake.requests == []


def test_one_failing_choice_fails_the_response() -> None:
    def script(request: GenerationRequest) -> list[OutputEvent]:
        if request.request_id.endswith("-2"):
            return [Failed(ErrorKind.INTERNAL, "boom")]
        return per_choice(request)
    client, _ = http(script)
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 3})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]


def test_a_refused_request_is_refused_once() -> None:
    client, fake = http([Failed(ErrorKind.INVALID_REQUEST, "bad grammar", "response_format")])
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 4})
    assert r.status_code == 400 and len(fake.requests) == 1  # choice 0 goes first


def test_merge_deltas_joins_logprobs_in_order() -> None:
    merged = merge_deltas([TextDelta(Channel.ANSWER, "Hel", (HEL,)),
                           TextDelta(Channel.ANSWER, "lo", (LO,)),
                           TextDelta(Channel.ANSWER, "", (BANG,))])
    assert merged == [TextDelta(Channel.ANSWER, "Hello", (HEL, LO, BANG))]


def test_trail_holds_entries_until_text_and_flushes_before_finished() -> None:
    trail = LogprobTrail(1, TokenPieces(lambda ids: {1: "a", 2: "b", 3: "<eos>"}[ids[0]]))
    picked = Picked(-0.5, ((1, -0.5),))
    # token 1 makes no text yet (held): its entry waits
    assert trail.on_token([], Generated(1, None, picked, 0)) == []
    out = trail.on_token([TextDelta(Channel.ANSWER, "ab")], Generated(2, None, Picked(-1.0, ()), 0))
    assert [e.token for e in out[0].logprobs] == ["a", "b"]  # type: ignore[union-attr]
    trail.on_token([], Generated(1, None, picked, 0))
    end = Finished(FinishReason.EOS, USAGE)
    out = trail.on_token([end], Generated(3, "stop", picked, 0))  # EOS has no entry
    assert out == [TextDelta(Channel.ANSWER, "", (TokenLogprob("a", 1, -0.5, (("a", -0.5),)),)),
                   end]
    with pytest.raises(RuntimeError):  # no numbers for this row: the request fails alone
        trail.on_token([], Generated(1, None, None, 0))
