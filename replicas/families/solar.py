"""Solar (Upstage Solar Open 2 / Solar Pro 4): reasoning between the single tokens
`<|think:start|>` and `<|think:end|>` (`think_colon`, the third single-token pair of
mlx-lm 0.32's `_infer_thinking`). Its `<|tool_call:start|>` call markup is not one Orchard
reads, so the family has no tool format and no test model.
"""

from __future__ import annotations

from replicas.families.family import Family
from replicas.families.reasoning import tagged_reasoning

__all__ = ["FAMILY", "THINK_COLON"]

THINK_COLON = tagged_reasoning("think_colon", "<|think:start|>", "<|think:end|>",
                               signature=("<|think:start|>", "<|think:end|>"))

FAMILY = Family("solar", reasoning=THINK_COLON)
