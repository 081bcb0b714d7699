"""OpenAI's reasoning effort -> thinking, one mapping for both of its APIs: chat's
`reasoning_effort` and the Responses API's `reasoning.effort`, so the same word means the
same thinking on either route."""

from __future__ import annotations

from typing import Final, Literal

from replicas.contract import ReasoningSpec

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

# Effort -> thinking budget in tokens. "xhigh" (newer clients) is the largest budget, and
# "high" for chat templates, which know OpenAI's three levels only.
EFFORT_BUDGET: Final = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
# These turn thinking off (templates have no "less than low").
THINKING_OFF: Final = ("none", "minimal")


def effort_reasoning(effort: Effort | None) -> ReasoningSpec:
    """The thinking an effort asks for; None: the model's default."""
    if effort is None:
        return ReasoningSpec()
    if effort in THINKING_OFF:
        return ReasoningSpec(enabled=False)
    return ReasoningSpec(enabled=True, budget_tokens=EFFORT_BUDGET[effort],
                         effort="high" if effort == "xhigh" else effort)
