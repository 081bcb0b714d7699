"""vLLM's tokenizer endpoints over `serve run` with the real tiny model: ids as generation
runs them (checked against the model's own tokenizer files and against usage), text back
from ids, what the tokenizer is, and 400s/404s in OpenAI's shape."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from replicas.builtin import ensure_builtin, script

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
PROMPT = script("count-completion").prompt


@pytest.fixture(scope="module")
def http(server: str) -> httpx.Client:
    return httpx.Client(base_url=server, timeout=60)


def test_a_prompt_tokenizes_as_the_models_tokenizer_and_a_completion_count(
        http: httpx.Client, server: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny")))
    body = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                        "add_special_tokens": False}).json()
    assert body["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] >= 1024
    # `model` left out: the config's first model.
    assert http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"] == body["tokens"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": PROMPT}


def test_messages_tokenize_as_a_chat_request_renders_them(http: httpx.Client,
                                                          server: str) -> None:
    hello = script("hello")
    body = http.post("/tokenize", json={"model": MODEL, "messages": hello.message_dicts}).json()
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=hello.message_dicts,
                                          max_tokens=1)
    assert body["count"] == chat.usage.prompt_tokens
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>user\nHello!") and text.endswith("<|im_start|>assistant\n")
    off = http.post("/tokenize", json={"messages": hello.message_dicts,
                                       "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["count"] > body["count"]  # the empty think block the template writes


def test_tokenizer_info(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info == http.get("/tokenizer_info", params={"model": MODEL}).json()


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/tokenize", '{"prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate, as JSON
])
def test_bad_input_is_an_openai_error(http: httpx.Client, path: str,
                                      body: dict[str, object] | str, status: int,
                                      param: str) -> None:
    r = http.post(path, content=body, headers={"content-type": "application/json"}) \
        if isinstance(body, str) else http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert http.get("/tokenizer_info").status_code == 200  # still serving
