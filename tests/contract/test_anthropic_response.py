"""The Anthropic Messages adapter's non-streaming message: its shape, stop reasons and stop
sequences."""

from __future__ import annotations

from typing import Any

import pytest

from ingress.anthropic.render import STOP_REASONS
from replicas.contract import FinishReason
from tests.contract.anthropic_wire import MODEL, USAGE_BODY, body, done, http, say, think


STOPS = [
    (FinishReason.EOS, None, "end_turn", None),
    (FinishReason.STOP_SEQUENCE, "###", "stop_sequence", "###"),
    (FinishReason.STOP_TOKEN, 151645, "end_turn", None),
    (FinishReason.LENGTH, None, "max_tokens", None),
    (FinishReason.GRAMMAR_COMPLETE, None, "end_turn", None),
    (FinishReason.CANCELLED, None, "end_turn", None),
    (FinishReason.TOOL_CALLS, None, "tool_use", None),
]


def test_stop_table_covers_every_finish_reason() -> None:
    assert set(STOP_REASONS) == set(FinishReason) == {row[0] for row in STOPS}


@pytest.mark.parametrize("reason, stop, stop_reason, stop_sequence", STOPS)
def test_stop_reason_and_sequence(
    reason: FinishReason, stop: Any, stop_reason: str, stop_sequence: Any
) -> None:
    client, _ = http([say("Hello"), done(reason, stop)])
    message = client.post("/v1/messages", json=body()).json()
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)


def test_non_streaming_message_shape() -> None:
    client, _ = http([think("Hmm."), say("Four"), say("."), done()])
    message = client.post("/v1/messages", json=body()).json()
    assert message["id"].startswith("msg_")
    assert {key: value for key, value in message.items() if key != "id"} == {
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [
            {"type": "thinking", "thinking": "Hmm.", "signature": ""},
            {"type": "text", "text": "Four."},
        ],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": USAGE_BODY,
    }


def test_nothing_generated_is_empty_content() -> None:
    client, _ = http([say(""), done(FinishReason.STOP_SEQUENCE, "###")])
    assert client.post("/v1/messages", json=body()).json()["content"] == []
