"""The request an ingress adapter builds for one of the built-in model's scripts."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from replicas.builtin import Script, script
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    ReasoningSpec,
    SamplingParams,
    TextPrompt,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=400)


def script_request(sid: str | Script, **overrides: Any) -> GenerationRequest:
    """Greedy, with the script's messages, tools and thinking switch; `overrides` replace
    any GenerationRequest field."""
    s = script(sid) if isinstance(sid, str) else sid
    if s.kind == "completion":
        prompt: Any = TextPrompt(s.prompt or "")
        reasoning = ReasoningSpec()
    else:
        prompt = ChatPrompt(tuple(
            ChatMessage(m.role, m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                        name=m.name)
            for m in s.messages))
        reasoning = ReasoningSpec(enabled=s.enable_thinking)
    request = GenerationRequest(
        request_id=f"test-{s.id}-{time.monotonic_ns()}", model="tiny", prompt=prompt,
        sampling=GREEDY, reasoning=reasoning, tools=s.tools)
    return dataclasses.replace(request, **overrides)
