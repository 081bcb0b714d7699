"""The family registry: one detection order, from which both format tables come.

Detection follows mlx-lm 0.32 where two families could meet (`_infer_tool_parser` for the
calls, `_infer_thinking` for the reasoning); families whose signatures overlap are still
told apart. The orders below are pinned: a new family's place is a reviewed choice.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence

import pytest

import replicas.families
from replicas.families.family import Family
from replicas.families.registry import (
    CHANNEL_FORMATS,
    FAMILIES,
    TOOL_FORMATS,
    detect_channel_format,
    detect_tool_format,
)


def test_the_format_tables_follow_the_family_order() -> None:
    assert list(CHANNEL_FORMATS) == ["harmony", "think_tags", "longcat_think", "think_colon",
                                     "gemma4", "xtml", "none"]
    assert list(TOOL_FORMATS) == [
        "harmony", "minimax_m2", "longcat", "gemma4", "function_gemma", "kimi_k2", "kimi_k3",
        "deepseek_v31", "glm47", "pythonic", "qwen3_coder", "minicpm5", "muse_spark",
        "hermes", "llama3_json", "mistral", "none"]


def test_every_family_module_is_registered() -> None:
    registered = {id(f) for f in FAMILIES}
    for info in pkgutil.iter_modules(replicas.families.__path__):
        module = importlib.import_module(f"replicas.families.{info.name}")
        exported = getattr(module, "FAMILIES", ()) or (getattr(module, "FAMILY", None),)
        for family in exported:
            if isinstance(family, Family):
                assert id(family) in registered, f"{info.name}: {family.name} not registered"


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        # The families that share `<tool_call>` are still told apart.
        ("<tool_call>\n<function=x>\n<parameter=y>", {"<tool_call>"}, "qwen3_coder"),
        (None, {"<tool_call>", "</tool_call>"}, "hermes"),
        # ... and every other family as before.
        ("<|tool_call_start|>", {"<|tool_call_start|>", "<|tool_call_end|>"}, "pythonic"),
        (None, {"<|channel|>", "<|message|>"}, "harmony"),
    ],
)
def test_detect_from_template_or_vocab(template: str | None, vocab: Sequence[str],
                                       want: str) -> None:
    assert detect_tool_format(template, vocab) == want


@pytest.mark.parametrize(("vocab", "want"), [
    # A single-token pair wins, as in mlx-lm's `_infer_thinking`.
    ({"<think>", "</think>", "<|channel>", "<channel|>"}, "think_tags"),
    ({"<|channel|>", "<|message|>"}, "harmony"),
])
def test_reasoning_formats_are_detected_as_mlx_lm_does(vocab: set[str], want: str) -> None:
    assert detect_channel_format(None, vocab) == want
