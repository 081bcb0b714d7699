"""Logprobs and `n` over real HTTP with the official openai SDK (`serve run` + tiny)."""

from __future__ import annotations

import functools
import math
from typing import Any

import openai
import pytest

from replicas.builtin import ensure_builtin, script

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
HELLO = script("hello")  # a scripted turn the tiny model answers (no reasoning)
MESSAGES = HELLO.message_dicts
PROMPT = script("count-completion").prompt


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def check_chat_entries(content: list[Any], top: int) -> None:
    assert content
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == top
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-4


def test_chat_logprobs_body_and_stream(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=64,
                                logprobs=True, top_logprobs=3)
    body = client.chat.completions.create(**args)
    content = body.choices[0].logprobs.content
    check_chat_entries(content, 3)
    streamed = []
    text = []
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]
    assert "".join(text) == body.choices[0].message.content == HELLO.answer


def test_completion_logprobs(client: openai.OpenAI) -> None:
    body = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                     max_tokens=12, logprobs=2)
    lp = body.choices[0].logprobs
    assert lp.tokens and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
        == len(lp.text_offset)
    assert "".join(lp.tokens) == body.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(value) and value == max(top.values())
    assert lp.text_offset[0] == 0
    stream = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                       max_tokens=12, logprobs=2, stream=True)
    tokens = [t for c in stream if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_completion_echo_scores_the_prompt(client: openai.OpenAI) -> None:
    """`echo` + `logprobs`: the prompt's tokens come first, the first without a logprob, as
    evaluation harnesses read them; streamed or not, the same tokens and numbers."""
    answer = script("count-completion").answer
    args: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=64,
                                logprobs=1, echo=True)
    body = client.completions.create(**args)
    choice = body.choices[0]
    assert choice.text == PROMPT + answer
    lp = choice.logprobs
    prompt_tokens = body.usage.prompt_tokens
    assert len(lp.tokens) == prompt_tokens + body.usage.completion_tokens - 1  # the eos has none
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # The generated part is greedy: each token heads its own top list.
    for token, value, top in zip(lp.tokens[prompt_tokens:], lp.token_logprobs[prompt_tokens:],
                                 lp.top_logprobs[prompt_tokens:]):
        assert top[token] == pytest.approx(value) and value == max(top.values())
    plain = client.completions.create(**{**args, "echo": False})
    assert plain.choices[0].logprobs.tokens == lp.tokens[prompt_tokens:]
    chunks = list(client.completions.create(stream=True, **args))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    streamed = [(t, v) for c in chunks if c.choices and c.choices[0].logprobs
                for t, v in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]
    assert [t for t, _ in streamed] == lp.tokens
    assert [None if v is None else round(v, 4) for _, v in streamed] == \
        [None if v is None else round(v, 4) for v in lp.token_logprobs]


def test_echo_ranks_the_scripted_continuation_first(client: openai.OpenAI) -> None:
    """A loglikelihood request as lm-eval sends it (token ids, `max_tokens` 1): every token
    of the scripted continuation is the model's most likely one, a wrong one is not."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny")))
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    context = encode(PROMPT)
    ctxlen = len(context)
    args: dict[str, Any] = dict(model=MODEL, temperature=0, max_tokens=1, logprobs=1, echo=True)
    right = client.completions.create(prompt=context + encode(script("count-completion").answer),
                                      **args).choices[0].logprobs
    wrong = client.completions.create(prompt=context + encode("3\n5\n4\n6"),
                                      **args).choices[0].logprobs

    def score(lp: Any) -> tuple[float, bool]:
        values, tops = lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]
        return sum(values), all(v == max(t.values()) for v, t in zip(values, tops))

    assert score(right)[1] and not score(wrong)[1]
    assert score(right)[0] / (len(right.tokens) - ctxlen - 1) > \
        score(wrong)[0] / (len(wrong.tokens) - ctxlen - 1)


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_in_one_completions_request(client: openai.OpenAI, stream: bool) -> None:
    """A batch of prompts (text, or token ids as harnesses send them): one choice each, in
    prompt order, each the script's own answer."""
    scripts = [script("count-completion"), script("story-completion")]
    args: dict[str, Any] = dict(model=MODEL, prompt=[s.prompt for s in scripts],
                                temperature=0, max_tokens=200)
    if not stream:
        body = client.completions.create(**args)
        assert [c.text for c in body.choices] == [s.answer for s in scripts]
        one = [client.completions.create(**{**args, "prompt": s.prompt}) for s in scripts]
        assert body.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)
        return
    parts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
    assert [parts[i] for i in sorted(parts)] == [s.answer for s in scripts]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n(client: openai.OpenAI, stream: bool) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10, n=3)
    if not stream:
        body = client.chat.completions.create(**args)
        assert [c.index for c in body.choices] == [0, 1, 2]
        texts = {c.message.content for c in body.choices}
        assert len(texts) == 1 and texts != {""}  # greedy: three equal choices
        one = client.chat.completions.create(**{**args, "n": 1})
        assert body.usage.prompt_tokens == one.usage.prompt_tokens
        assert body.usage.completion_tokens == 3 * one.usage.completion_tokens
        return
    parts: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert sorted(parts) == [0, 1, 2] and finished == {0, 1, 2}
    assert len(set(parts.values())) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_completion_n(client: openai.OpenAI, stream: bool) -> None:
    args: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, temperature=0.8,
                                max_tokens=8, n=3)
    if not stream:
        body = client.completions.create(**args)
        assert [c.index for c in body.choices] == [0, 1, 2]
        assert all(c.finish_reason in ("stop", "length") for c in body.choices)
        return
    seen = set()
    for chunk in client.completions.create(stream=True, **args):
        seen.update(c.index for c in chunk.choices)
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("extra", [{"logprobs": True, "top_logprobs": 21}, {"n": 0}])
def test_out_of_range_is_an_openai_400(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **extra)
    error = caught.value.body
    assert isinstance(error, dict) and error.get("type") == "invalid_request_error"
    assert error.get("param") in ("top_logprobs", "n")
