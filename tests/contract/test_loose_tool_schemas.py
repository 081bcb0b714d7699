"""Loose tool schemas, as real clients send them, through the official SDKs: a Responses
tool with `strict` omitted and a loose schema is served, keywords the grammar cannot
enforce are left out with a warning, and only an explicit `strict: true` still refuses.

The fake client compiles the request's tool grammar as the replica does (the built-in
model's tokenizer), so the SDK sees the replica's answer: a 400, or warnings.
"""

from __future__ import annotations

from typing import Any, Sequence

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.protocol import WARNINGS_FIELD
from replicas.contract import Channel, Finished, FinishReason, GenerationRequest, TextDelta, Usage
from replicas.pipeline.guided.tools import compile_tool_grammar
from tests.fakes import FakeClient, Step
from tests.unit.test_guided_tools import builtin_guided_tokenizer

MODEL = "orchard-tiny"
LOOSE = {"type": "object", "properties": {"city": {"type": "string"}}}  # no additionalProperties
FETCH = {"type": "object", "required": ["url"], "properties": {"url": {
    "type": "string", "format": "uri", "title": "URL", "deprecated": False,
    "examples": ["https://example.com"], "x-order": 1,
    "$schema": "http://json-schema.org/draft-07/schema#"}}}


def replica_like(tool_format: str) -> FakeClient:
    def script(request: GenerationRequest) -> Sequence[Step]:
        compiled = compile_tool_grammar(tool_format, request.tools, request.tool_choice,
                                        tokenizer=builtin_guided_tokenizer())
        warnings = compiled.warnings if compiled is not None else ()
        return [TextDelta(Channel.ANSWER, "Done."),
                Finished(FinishReason.EOS, Usage(5, 2), warnings=warnings)]

    return FakeClient(script)


def openai_sdk(fake: FakeClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0,
                         http_client=TestClient(create_app(fake)))


def responses_tool(schema: dict[str, Any], **extra: Any) -> Any:
    return {"type": "function", "name": "fetch", "parameters": schema, **extra}


def test_responses_tool_with_strict_omitted_and_a_loose_schema_is_served() -> None:
    fake = replica_like("hermes")
    response = openai_sdk(fake).responses.create(model=MODEL, input="Weather in Paris?",
                                                 tools=[responses_tool(LOOSE)])
    assert response.output_text == "Done."
    assert fake.requests[0].tools[0].strict is False


def test_responses_explicit_strict_with_a_loose_schema_is_still_a_400() -> None:
    fake = replica_like("hermes")
    with pytest.raises(openai.BadRequestError) as raised:
        openai_sdk(fake).responses.create(model=MODEL, input="Weather in Paris?",
                                          tools=[responses_tool(LOOSE, strict=True)])
    assert "strict mode" in str(raised.value) and "additionalProperties: false" in str(raised.value)


@pytest.mark.parametrize("tool_format", ["qwen3_coder", "hermes"])
def test_responses_unenforceable_keywords_are_a_warning_not_a_400(tool_format: str) -> None:
    schema = {**FETCH, "properties": {**FETCH["properties"], "tags": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    raw = openai_sdk(replica_like(tool_format)).responses.with_raw_response.create(
        model=MODEL, input="Fetch it.", tools=[responses_tool(schema, strict=False)])
    warnings = raw.http_response.json()[WARNINGS_FIELD]
    assert any("tool 'fetch'" in w and "uniqueItems" in w for w in warnings)
    # Raw text cannot check a URL's format; the JSON formats can.
    assert any("parameter 'url': format" in w for w in warnings) == (tool_format == "qwen3_coder")


def test_openai_chat_qwen3_coder_annotated_string_is_served_with_a_warning() -> None:
    tools: Any = [{"type": "function", "function": {"name": "fetch", "parameters": FETCH}}]
    raw = openai_sdk(replica_like("qwen3_coder")).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Fetch it."}], tools=tools)
    body = raw.http_response.json()
    assert body["choices"][0]["message"]["content"] == "Done."
    [warning] = body[WARNINGS_FIELD]
    assert "tool 'fetch'" in warning and "parameter 'url': format" in warning


def test_openai_chat_explicit_strict_qwen3_coder_format_is_still_a_400() -> None:
    strict = {**FETCH, "additionalProperties": False}
    tools: Any = [{"type": "function", "function": {"name": "fetch", "parameters": strict,
                                                    "strict": True}}]
    with pytest.raises(openai.BadRequestError, match="cannot enforce parameter 'url': format"):
        openai_sdk(replica_like("qwen3_coder")).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Fetch it."}], tools=tools)


def test_anthropic_qwen3_coder_annotated_string_is_served_with_a_warning() -> None:
    client = anthropic.Anthropic(base_url="http://testserver", api_key="x", max_retries=0,
                                 http_client=TestClient(create_app(replica_like("qwen3_coder"))))
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Fetch it."}],
        tools=[{"name": "fetch", "input_schema": FETCH}])
    body = raw.http_response.json()
    assert body["content"] == [{"type": "text", "text": "Done."}]
    [warning] = body[WARNINGS_FIELD]
    assert "tool 'fetch'" in warning and "parameter 'url': format" in warning
