"""A lone UTF-16 surrogate a client sent (JSON allows `"\\ud800"`) and a response echoes
must not turn the response into a 500: bodies and SSE frames fall back to ASCII escapes."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.sse import data_frame
from ingress.wire_json import dumps
from tests.fakes import FakeClient


def test_plain_text_stays_utf8_and_surrogates_are_escaped() -> None:
    assert dumps({"t": "café"}) == '{"t":"café"}'
    escaped = dumps({"t": "a\udc00b"})
    assert escaped == '{"t":"a\\udc00b"}' and json.loads(escaped) == {"t": "a\udc00b"}
    data_frame({"t": "a\ud800"}).encode("utf-8")  # would raise without the fallback


def test_echoed_surrogates_are_the_apis_own_4xx() -> None:
    http = TestClient(create_app(FakeClient([])))
    for path, body, param in [
        ("/v1/responses", b'{"model":"orchard-tiny","input":"hi","previous_response_id":"a\\udc00"}',
         "previous_response_id"),
        ("/v1/chat/completions", b'{"model":"x\\ud800","messages":[{"role":"user","content":"x"}]}',
         "model"),
    ]:
        reply = http.post(path, content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["param"] == param
