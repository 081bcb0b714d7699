"""The Anthropic Messages adapter's request errors: Anthropic-shaped 400s and 404s, before any
replica time."""

from __future__ import annotations

from typing import Any

import pytest

from tests.contract.anthropic_wire import MODEL, USER, body, http


BAD_REQUESTS = {
    "missing max_tokens": ({"max_tokens": None}, "max_tokens"),
    "zero max_tokens": ({"max_tokens": 0}, "max_tokens"),
    "empty messages": ({"messages": []}, "messages"),
    "unknown role in messages": (
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages.0.role",
    ),
    "only system messages": (
        {"messages": [{"role": "system", "content": "x"}]},
        "first message",
    ),
    "assistant after a leading system message": (
        {"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "first message",
    ),
    "empty system message": (
        {"messages": USER + [{"role": "system", "content": ""}]},
        "messages.1: all messages must have non-empty content",
    ),
    "assistant first": (
        {"messages": [{"role": "assistant", "content": "x"}] + USER},
        "first message",
    ),
    "empty user message": ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    "empty text block": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "non-empty",
    ),
    "prefill ends in whitespace": (
        {"messages": USER + [{"role": "assistant", "content": "A "}]},
        "trailing whitespace",
    ),
    "empty stop sequence": ({"stop_sequences": [""]}, "stop_sequences.0"),
    "non-string stop sequence": ({"stop_sequences": [7]}, "stop_sequences.0"),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    "zero thinking budget": (
        {"thinking": {"type": "enabled", "budget_tokens": 0}},
        "budget_tokens",
    ),
    "budget not below max_tokens": (
        {"thinking": {"type": "enabled", "budget_tokens": 32}},
        "max_tokens",
    ),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
        "tools.0: tool type 'web_search_20250305' is not supported",
    ),
    "bash tool": (
        {"tools": [{"type": "bash_20250124", "name": "bash"}]},
        "'bash_20250124'",
    ),
    "text editor tool": (
        {"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]},
        "'text_editor_20250728'",
    ),
    "computer tool": (
        {"tools": [{"type": "computer_20250124", "name": "computer", "display_width_px": 1}]},
        "'computer_20250124'",
    ),
    "custom tool without a schema": ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    "tool without a name": ({"tools": [{"input_schema": {}}]}, "tools.0.name"),
    "duplicate tool names": (
        {"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]},
        "unique",
    ),
    "tool_choice naming an unknown tool": (
        {
            "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        "tool_choice.name: 'g'",
    ),
    "tool_choice any without tools": ({"tool_choice": {"type": "any"}}, "requires tools"),
    "unknown tool_choice type": ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    "tool_result for no tool_use": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ]
        },
        "messages.0.content.0: tool_result block(s) provided with tool_use_id 'toolu_x'",
    ),
    "tool_use in a user message": (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                    "name": "f", "input": {}}]}]},
        "tool_use blocks are only allowed in assistant messages",
    ),
    "tool_use input not an object": (
        {"messages": USER + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]}]},
        "messages.1.content.0.tool_use.input",
    ),
    "tool_result in an assistant message": (
        {"messages": USER + [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "1"}]}]},
        "tool_result blocks are only allowed in user messages",
    ),
    "thinking in a system message": (
        {"messages": [{"role": "system", "content": [{"type": "thinking", "thinking": "x"}]}]
         + USER},
        "thinking blocks are only allowed in assistant messages",
    ),
    "unknown effort": ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
}


@pytest.mark.parametrize("overrides, named", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_are_anthropic_400s(overrides: dict[str, Any], named: str) -> None:
    client, fake = http()
    request = {key: value for key, value in body(**overrides).items() if value is not None}
    response = client.post("/v1/messages", json=request)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    assert fake.requests == []


@pytest.mark.parametrize(
    # image and document blocks are placeholders instead (test_media_placeholders.py).
    "kind", ["server_tool_use", "web_search_tool_result", "redacted_thinking"]
)
def test_unsupported_blocks_are_named_in_a_400(kind: str) -> None:
    client, _ = http()
    content = [{"type": "text", "text": "Look:"}, {"type": kind, "source": {}}]
    response = client.post(
        "/v1/messages", json=body(messages=[{"role": "user", "content": content}])
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "messages.0.content.1" in message and kind in message and "not supported" in message


def test_invalid_json_is_a_400() -> None:
    client, _ = http()
    response = client.post(
        "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": "request body is not valid JSON",
    }


def test_unknown_model_is_a_404_listing_the_served_models() -> None:
    client, _ = http()
    for path, request in [
        ("/v1/messages", body(model="gpt-9")),
        ("/v1/messages/count_tokens", {"model": "gpt-9", "messages": USER}),
    ]:
        response = client.post(path, json=request)
        assert response.status_code == 404
        error = response.json()["error"]
        assert (
            error["type"] == "not_found_error"
            and "gpt-9" in error["message"]
            and MODEL in error["message"]
        )
