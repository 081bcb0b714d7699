"""Per-request records (ingress.observe) and request log lines (ingress.request_log)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.observe import FanOut, RequestRecord
from ingress.request_log import RequestLogger, format_line
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    TextDelta,
    Usage,
)
from replicas.errors import InvalidRequestError
from tests.fakes import FakeClient

USAGE = Usage(prompt_tokens=7, completion_tokens=3, reasoning_tokens=1, cached_tokens=4)
SECRET = "the-prompt-text-must-not-leak"
SCRIPT = [TextDelta(Channel.ANSWER, "out"), TextDelta(Channel.ANSWER, "put"),
          TextDelta(Channel.ANSWER, "!"), Finished(FinishReason.EOS, USAGE)]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": SECRET}]}


class Collect:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def request_finished(self, record: RequestRecord) -> None:
        self.records.append(record)


def _app(script: object = SCRIPT) -> tuple[TestClient, Collect]:
    seen = Collect()
    client = FakeClient(script)  # type: ignore[arg-type]
    app = create_app(client, observer=FanOut((seen, RequestLogger())))
    return TestClient(app), seen


def test_streaming_and_non_streaming_records_agree() -> None:
    http, seen = _app()
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        r.read()
    assert http.get("/health").status_code == 200  # not a generation: no record
    plain, streamed = seen.records
    for record in (plain, streamed):
        assert record.model == "orchard-tiny"  # the id, not the alias the client sent
        assert (record.protocol, record.endpoint) == ("openai", "/v1/chat/completions")
        assert record.status == 200 and record.error is None and not record.cancelled
        assert record.usage == USAGE and record.finish_reason is FinishReason.EOS
        assert record.request_id is not None and record.request_id.startswith("chatcmpl")
        assert record.ttft_s is not None and 0 <= record.ttft_s <= record.duration_s
        assert record.itl_s is not None and record.itl_s >= 0
    assert (plain.streaming, streamed.streaming) == (False, True)
    assert plain.request_id != streamed.request_id


def test_each_protocol_is_labelled() -> None:
    http, seen = _app()
    http.post("/v1/messages", json={**CHAT, "max_tokens": 5})
    http.post("/v1/responses", json={"model": "tiny", "input": "hi"})
    http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert [(r.protocol, r.endpoint, r.status) for r in seen.records] == [
        ("anthropic", "/v1/messages", 200), ("responses", "/v1/responses", 200),
        ("openai", "/v1/completions", 200)]


def test_errors_are_recorded_by_kind() -> None:
    http, seen = _app([Failed(ErrorKind.OVERLOADED, "busy")])
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 503
    assert http.post("/v1/messages", json={**CHAT, "max_tokens": 5}).status_code == 529
    assert http.post("/v1/chat/completions", json={"model": "tiny"}).status_code == 400
    busy, busy_anthropic, invalid = seen.records
    assert (busy.status, busy.error, busy.ttft_s) == (503, ErrorKind.OVERLOADED, None)
    assert (busy_anthropic.status, busy_anthropic.error) == (529, ErrorKind.OVERLOADED)
    # Refused before a generation request existed: labelled with the only model.
    assert (invalid.status, invalid.error, invalid.request_id) == (
        400, ErrorKind.INVALID_REQUEST, None)
    assert invalid.model == "orchard-tiny"
    assert not any(r.cancelled for r in seen.records)


def test_without_an_observer_nothing_is_wrapped() -> None:
    app = create_app(FakeClient(SCRIPT))
    assert type(app.state.client).__name__ == "LimitedClient"


@pytest.mark.parametrize("json_lines", [False, True])
def test_request_log_line_has_the_fields_and_no_text(
        json_lines: bool, caplog: pytest.LogCaptureFixture) -> None:
    seen = Collect()
    app = create_app(FakeClient(SCRIPT), observer=FanOut((seen, RequestLogger(json_lines))))
    with caplog.at_level(logging.INFO, logger="orchard.requests"):
        TestClient(app).post("/v1/chat/completions", json=CHAT)
    lines = [r.getMessage() for r in caplog.records if r.name == "orchard.requests"]
    assert len(lines) == 1
    line = lines[0]
    assert SECRET not in line and "output!" not in line
    record = seen.records[0]
    if json_lines:
        fields = json.loads(line)
        assert fields["request_id"] == record.request_id
        assert (fields["model"], fields["protocol"], fields["finish_reason"]) == (
            "orchard-tiny", "openai", "eos")
        assert (fields["prompt_tokens"], fields["cached_tokens"], fields["output_tokens"]) == (
            7, 4, 3)
        assert fields["ttft_ms"] is not None and fields["duration_ms"] >= fields["ttft_ms"]
    else:
        assert line.startswith("request ")
        for part in (f"request_id={record.request_id}", "model=orchard-tiny",
                     "protocol=openai", "prompt_tokens=7", "cached_tokens=4",
                     "output_tokens=3", "finish_reason=eos", "status=200"):
            assert part in line.split(" "), part
    assert line == format_line(record, json_lines)


def test_an_embeddings_request_is_recorded_with_its_tokens() -> None:
    http, seen = _app()
    assert http.post("/v1/embeddings", json={"model": "tiny", "input": ["abc", SECRET]}
                     ).status_code == 200
    refused = FakeClient(embed_error=InvalidRequestError("no embeddings", param="model"))
    observed = Collect()
    assert TestClient(create_app(refused, observer=observed)).post(
        "/v1/embeddings", json={"model": "tiny", "input": "x"}).status_code == 400
    (record,) = seen.records
    assert (record.protocol, record.endpoint, record.status) == ("openai", "/v1/embeddings", 200)
    assert record.model == "orchard-tiny" and record.request_id is not None
    assert record.request_id.startswith("emb-") and record.error is None
    assert record.usage == Usage(prompt_tokens=3 + len(SECRET), completion_tokens=0)
    assert not record.cancelled and record.finish_reason is None
    (failed,) = observed.records
    assert failed.status == 400 and failed.error is ErrorKind.INVALID_REQUEST
