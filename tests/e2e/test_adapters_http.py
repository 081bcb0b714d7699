"""LoRA adapters over a real `serve run` on loopback, through the official `openai` and
`anthropic` SDKs: a model served with two adapters (random-weight, made with mlx-lm's own
tuner classes: `replicas.builtin.adapters`), picked by `model: "BASE:NAME"` or an alias;
`/v1/models` lists each; an adapter the model does not serve is a 400 in each API's shape,
and the server keeps serving. Served by the shared app (`shared_app.py`) beside the other
modules' models.

Greedy output is checked against mlx-lm's own generation with that adapter loaded alone
(`mlx_lm.load(path, adapter_path=...)`), on the same token ids.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from replicas.builtin import ensure_builtin
from replicas.builtin.adapters import builtin_adapter
from tests.observability.test_observability_http import App

pytestmark = pytest.mark.e2e

BASE = "orchard-lora"
ADAPTERS = {"alpha": (1, False), "beta": (2, True)}  # name: (seed, DoRA)
RUNTIME = {"gamma": (3, False)}  # loaded through POST /v1/adapters, not the config
MODELS = [
    {"id": BASE, "source": "builtin:tiny", "max_ongoing_requests": 16,
     "adapters": {
         "alpha": {"path": str(builtin_adapter("tiny", "alpha", 1, build=False)),
                   "aliases": ["tiny-alpha"]},
         "beta": str(builtin_adapter("tiny", "beta", 2, dora=True, build=False)),
     }},
]
PROMPT = [9, 30, 41, 52, 63, 74, 85]
MAX_TOKENS = 8


def ensure_adapters() -> None:
    """The adapters MODELS names, built before the app starts (`shared_app.py`)."""
    for name, (seed, dora) in {**ADAPTERS, **RUNTIME}.items():
        builtin_adapter("tiny", name, seed, dora=dora)


@pytest.fixture(scope="module")
def base_url(shared_app: App) -> str:
    return shared_app.serve.base_url


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0,
                               timeout=120)


def reference_text(adapter: str | None) -> str:
    """mlx-lm alone: the model with that adapter loaded, greedy on PROMPT, to EOS."""
    path = ensure_builtin("tiny")
    model, tokenizer = mlx_load(str(path), adapter_path=str(
        builtin_adapter("tiny", adapter, *{**ADAPTERS, **RUNTIME}[adapter])) if adapter
        else None)[:2]
    tokens = []
    for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return str(tokenizer.decode(tokens))


def complete(oai: openai.OpenAI, model: str) -> str:
    answer = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0.0)
    return answer.choices[0].text


def test_models_lists_every_adapter(base_url: str) -> None:
    listed = {m["id"]: m for m in httpx.get(f"{base_url}/v1/models").json()["data"]}
    for name in (f"{BASE}:alpha", f"{BASE}:beta", "tiny-alpha"):
        assert listed[name]["root"] == BASE, name


def test_each_adapter_equals_mlx_lm_alone(oai: openai.OpenAI) -> None:
    texts = {name: complete(oai, f"{BASE}:{name}") for name in ADAPTERS}
    texts[None] = complete(oai, BASE)  # type: ignore[index]
    for name, text in texts.items():
        assert text == reference_text(name), name
    assert len(set(texts.values())) == 3  # each adapter changes the output
    assert complete(oai, "tiny-alpha") == texts["alpha"]  # the alias is the pair


def test_anthropic_picks_an_adapter(claude: anthropic.Anthropic) -> None:
    """The Messages API renders its own prompt, so its answer is compared with itself: the
    adapter's differs from the base's, and a second request under it answers alike."""
    def say(model: str) -> str:
        # This SDK takes no `temperature` argument: it rides in the body, as the other
        # Anthropic tests send it.
        reply = claude.messages.create(model=model, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"temperature": 0})
        assert reply.model == BASE
        return "".join(b.text for b in reply.content if b.type == "text")

    adapted = say(f"{BASE}:beta")
    assert adapted != say(BASE)
    assert say(f"{BASE}:beta") == adapted


def test_an_unknown_adapter_is_a_400_in_each_shape(oai: openai.OpenAI,
                                                    claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        complete(oai, f"{BASE}:nope")
    assert caught.value.status_code == 400
    body: Any = caught.value.body
    assert "adapter 'nope'" in body["message"] and body["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=f"{BASE}:nope", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 400
    error: Any = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "adapter 'nope'" in error["error"]["message"]
    assert complete(oai, f"{BASE}:alpha")  # still serving


def test_an_adapter_loaded_and_unloaded_at_run_time(base_url: str, oai: openai.OpenAI) -> None:
    """`POST /v1/adapters` loads gamma onto the running model: it is listed, served under
    `BASE:gamma` and its alias, greedy-equal to mlx-lm with gamma alone; `DELETE` unloads
    it, and it is then a 400, and a second `DELETE` a 404. Bad loads change nothing."""
    url = f"{base_url}/v1/adapters"
    path = str(builtin_adapter("tiny", "gamma", *RUNTIME["gamma"], build=False))
    bad = httpx.post(url, json={"model": BASE, "name": "gamma", "path": path + "-missing"},
                     timeout=120)
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    assert httpx.post(url, json={"model": "no-such-model", "name": "gamma", "path": path},
                      timeout=60).status_code == 404
    assert httpx.post(url, json={"model": BASE, "name": "alpha", "path": path},
                      timeout=60).status_code == 409
    loaded = httpx.post(url, json={"model": BASE, "name": "gamma", "path": path,
                                   "aliases": ["tiny-gamma"]}, timeout=120)
    try:
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["replicas"] >= 1
        listed = {m.id for m in oai.models.list()}
        assert {f"{BASE}:gamma", "tiny-gamma", f"{BASE}:alpha"} <= listed
        text = complete(oai, f"{BASE}:gamma")
        assert text == reference_text("gamma")
        assert text != complete(oai, BASE)
        assert complete(oai, "tiny-gamma") == text
        chat = oai.chat.completions.create(model=f"{BASE}:gamma", max_tokens=MAX_TOKENS,
                                           messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0.0)
        assert chat.model == f"{BASE}:gamma" and chat.choices[0].message.content
    finally:
        gone = httpx.delete(f"{url}/{BASE}:gamma", timeout=60)
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.BadRequestError) as caught:
        complete(oai, f"{BASE}:gamma")
    assert "adapter 'gamma'" in caught.value.message
    assert httpx.delete(f"{url}/{BASE}:gamma", timeout=60).status_code == 404
    assert f"{BASE}:gamma" not in {m.id for m in oai.models.list()}
    assert complete(oai, f"{BASE}:alpha") == reference_text("alpha")  # still serving
