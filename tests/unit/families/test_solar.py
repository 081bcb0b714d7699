"""Solar's family: the `think_colon` reasoning (`<|think:start|>` ... `<|think:end|>`), no
tool format Orchard reads."""

from __future__ import annotations

from replicas.families.registry import detect_channel_format, detect_tool_format
from tests.unit.families.reasoning import A, R, splits_at_every_boundary

VOCAB = {"<|think:start|>", "<|think:end|>"}


def test_reasoning_is_detected_as_mlx_lm_does() -> None:
    assert detect_channel_format(None, VOCAB) == "think_colon"
    assert detect_tool_format(None, VOCAB) == "none"


def test_reasoning_markup_splits_at_every_boundary() -> None:
    splits_at_every_boundary("think_colon", "<|think:start|>Plan.<|think:end|>Answer",
                             [(R, "Plan."), (A, "Answer")])
