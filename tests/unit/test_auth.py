"""API keys, CORS and log hygiene at the HTTP edge (the real app, a fake client)."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from deployments.config import AppArgs
from deployments.ingress_deployment import EdgeArgs
from ingress.app import create_app
from ingress.auth import ApiKeys
from ingress.options import EdgeOptions
from replicas.contract import Channel, Finished, FinishReason, OutputEvent, TextDelta, Usage
from tests.fakes import FakeClient

KEY = "sk-orchard-test-0123456789"
WRONG = "sk-wrong-9876543210"
PROMPT = "the secret prompt text"
ANSWER: list[OutputEvent] = [TextDelta(Channel.ANSWER, "Hi"),
                             Finished(FinishReason.EOS, Usage(3, 1))]
CHAT = {"model": "orchard-tiny", "messages": [{"role": "user", "content": PROMPT}]}
MESSAGE = {"model": "orchard-tiny", "max_tokens": 8,
           "messages": [{"role": "user", "content": PROMPT}]}

ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/orchard-tiny", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "orchard-tiny", "prompt": PROMPT}),
    ("POST", "/v1/messages", MESSAGE),
    ("POST", "/v1/messages/count_tokens", {"model": "orchard-tiny", "messages": CHAT["messages"]}),
    ("GET", "/openapi.json", None),
    ("GET", "/no/such/route", None),
]


def http(keys: tuple[str, ...] = (KEY,), **options: Any) -> TestClient:
    edge = EdgeOptions(api_keys=frozenset(keys), **options)
    return TestClient(create_app(FakeClient(ANSWER), edge))


def test_health_needs_no_key() -> None:
    assert http().get("/health").status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_other_route_needs_a_key(method: str, path: str, body: Any) -> None:
    response = http().request(method, path, json=body)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    if path.startswith("/v1/messages"):
        assert response.json()["type"] == "error"  # Anthropic's shape
    else:
        assert error["code"] == "unauthorized"  # OpenAI's shape


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"},
                                     {"authorization": f"bearer {KEY}"},
                                     {"x-api-key": KEY},
                                     {"x-api-key": WRONG, "Authorization": f"Bearer {KEY}"}])
@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT),
                                            ("/v1/messages", MESSAGE)])
def test_either_header_carries_the_key(headers: dict[str, str], path: str, body: Any) -> None:
    assert http().post(path, json=body, headers=headers).status_code == 200


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {WRONG}"},
                                     {"Authorization": KEY},  # no scheme
                                     {"Authorization": f"Basic {KEY}"},
                                     {"x-api-key": ""}])
def test_a_wrong_or_malformed_key_is_refused_and_never_echoed(headers: dict[str, str]) -> None:
    response = http().post("/v1/messages", json=MESSAGE, headers=headers)
    assert response.status_code == 401
    assert WRONG not in response.text and KEY not in response.text


def test_no_keys_configured_means_no_authentication() -> None:
    assert http(keys=()).post("/v1/chat/completions", json=CHAT).status_code == 200


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ApiKeys(["first", "second", "third"])
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented in ("first", "third", "nope", "x" * 1000):
        calls.clear()
        keys.accepts(presented)
        assert calls == [64] * 3  # every key, fixed-length digests: no early exit, no length leak
    assert "first" not in repr(keys)


def test_keys_and_prompts_stay_out_of_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client = http()
    client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
    client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                headers={"Authorization": f"Bearer {KEY}"})
    client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": WRONG})
    client.post("/v1/chat/completions", json={**CHAT, "n": 3}, headers={"x-api-key": KEY})
    for record in caplog.records:
        text = record.getMessage()
        assert KEY not in text and WRONG not in text
        if record.levelno >= logging.INFO:
            assert PROMPT not in text


def test_cors_is_off_unless_configured() -> None:
    origin = {"Origin": "https://app.example"}
    response = http(keys=()).post("/v1/chat/completions", json=CHAT, headers=origin)
    assert "access-control-allow-origin" not in response.headers
    preflight = http(keys=()).options("/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_configured_cors_answers_preflights_without_a_key() -> None:
    client = http(cors_origins=("https://app.example",))
    preflight = client.options("/v1/messages", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-api-key, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    refused = client.post("/v1/messages", json=MESSAGE, headers={"Origin": "https://app.example"})
    assert refused.status_code == 401  # CORS is no substitute for the key ...
    assert refused.headers["access-control-allow-origin"] == "https://app.example"  # ... readable
    other = client.post("/v1/messages", json=MESSAGE,
                        headers={"Origin": "https://evil.example", "x-api-key": KEY})
    assert "access-control-allow-origin" not in other.headers


def test_keys_come_from_the_config_and_the_named_environment_variable() -> None:
    config = AppArgs.model_validate({"models": [{"id": "m", "source": "builtin:tiny"}],
                                     "api_keys": ["from-config"], "api_keys_env": "KEYS"})
    assert "from-config" not in repr(config)
    assert "from-config" not in repr(EdgeArgs.from_config(config))
    options = EdgeArgs.from_config(config).options({"KEYS": " one, two ,,"})
    assert options.api_keys == {"from-config", "one", "two"}
    assert "one" not in repr(options)
    with pytest.raises(ValueError, match="KEYS"):
        EdgeArgs.from_config(config).options({})  # named but unset: refuse to run open
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"models": [{"id": "m", "source": "builtin:tiny"}],
                                "api_keys": [" "]})


def test_under_a_route_prefix_health_is_open_and_errors_keep_their_shape() -> None:
    # Serve mounts an app under its route_prefix: the ASGI scope's root_path, left in path.
    mounted = TestClient(create_app(FakeClient(ANSWER), EdgeOptions(api_keys=frozenset({KEY}))),
                         root_path="/colo")
    assert mounted.get("/colo/health").status_code == 200
    refused = mounted.post("/colo/v1/messages", json=MESSAGE)
    assert refused.status_code == 401 and refused.json()["type"] == "error"  # Anthropic's
    unknown = mounted.post("/colo/v1/messages", json={**MESSAGE, "model": "nope"},
                           headers={"x-api-key": KEY})
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"
    assert mounted.post("/colo/v1/chat/completions", json=CHAT,
                        headers={"x-api-key": KEY}).json()["choices"][0]["message"]["content"] == "Hi"
