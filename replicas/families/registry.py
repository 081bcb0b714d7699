"""The model families in their one detection order, and the two format tables read off it.

`FAMILIES` is the order. `CHANNEL_FORMATS` lists each family's reasoning format where it
first appears in that order, `TOOL_FORMATS` each family's tool format in the same order;
detection takes the first format whose signature texts are all in the chat template or
the vocabulary. The plain family comes last: its `none` formats have empty signatures and
match every model.

The order is mlx-lm 0.32's, where two families could meet: `_infer_tool_parser` tries
the more specific markup first (MiniMax-M2 before the `<tool_call>` families, GLM's and
Qwen3-Coder's `<tool_call>` before Hermes' bare one), `_infer_thinking` the single-token
reasoning pairs (`<think>` from MiniMax-M2 on, LongCat's, Solar's) before the spelled-out
ones (Gemma 4's, Kimi K3's). The two lists disagree on one pair only: mlx-lm tries Gemma's
call markup before LongCat's but LongCat's reasoning before Gemma's, and a family sits in
one place. LongCat comes first here; no vocabulary holds both families' markers. DeepSeek
(not in mlx-lm), Kimi K3 (tied to its XTML) and Solar (no calls) share no signature text
with a family after them, so their places only keep their reasoning formats in order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar

from replicas.families import (
    deepseek,
    gemma,
    glm,
    harmony,
    kimi_k2,
    kimi_k3,
    lfm2,
    llama,
    longcat,
    minicpm,
    minimax,
    mistral,
    muse_spark,
    plain,
    qwen,
    qwen3_coder,
    solar,
)
from replicas.families.channel_format import ChannelFormat
from replicas.families.family import Family
from replicas.families.tool_format import ToolFormat

__all__ = [
    "CHANNEL_FORMATS",
    "FAMILIES",
    "TOOL_FORMATS",
    "detect_channel_format",
    "detect_tool_format",
    "get_channel_format",
    "get_tool_format",
]


def _checked(families: tuple[Family, ...]) -> tuple[Family, ...]:
    # The registry is code-reviewed data; a clash should fail at import, not mid-request.
    names = [f.name for f in families]
    if len(set(names)) != len(names):
        raise ValueError(f"family names must be unique: {names}")
    seeds = [f.template.seed for f in families if f.template is not None]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"test model seeds must be unique: {sorted(seeds)}")
    last = families[-1]
    if last.reasoning is None or last.tools is None or last.reasoning.signature or \
            last.tools.signature:
        raise ValueError("the last family must match every model (empty signatures)")
    return families


# One line per family module; a new family goes where its signature must be tried.
FAMILIES: tuple[Family, ...] = _checked((
    harmony.FAMILY,
    minimax.FAMILY,
    longcat.FAMILY,
    solar.FAMILY,
    *gemma.FAMILIES,
    kimi_k2.FAMILY,
    kimi_k3.FAMILY,
    deepseek.FAMILY,
    glm.FAMILY,
    lfm2.FAMILY,
    qwen3_coder.FAMILY,
    minicpm.FAMILY,
    muse_spark.FAMILY,
    qwen.FAMILY,
    llama.FAMILY,
    mistral.FAMILY,
    plain.FAMILY,  # last: matches every model
))


_Format = TypeVar("_Format", ChannelFormat, ToolFormat)


def _table(formats: Iterable[_Format], what: str) -> Mapping[str, _Format]:
    """name -> format, first appearance first; one object per name (families share a
    format by importing it, never by rebuilding it)."""
    table: dict[str, _Format] = {}
    for fmt in formats:
        if table.setdefault(fmt.name, fmt) is not fmt:
            raise ValueError(f"two {what} formats are named {fmt.name!r}")
    return MappingProxyType(table)


CHANNEL_FORMATS = _table((f.reasoning for f in FAMILIES if f.reasoning is not None), "channel")
TOOL_FORMATS = _table((f.tools for f in FAMILIES if f.tools is not None), "tool")
_FALLBACK = FAMILIES[-1]


def get_channel_format(name: str) -> ChannelFormat:
    return _get(CHANNEL_FORMATS, name, "channel")


def get_tool_format(name: str) -> ToolFormat:
    return _get(TOOL_FORMATS, name, "tool")


def _get(table: Mapping[str, _Format], name: str, what: str) -> _Format:
    try:
        return table[name]
    except KeyError:
        valid = ", ".join(sorted(table))
        raise ValueError(f"unknown {what} format {name!r}; valid formats: {valid}") from None


def _found(signature: tuple[str, ...], template: str, vocab: Collection[str]) -> bool:
    return all(text in vocab or text in template for text in signature)


def detect_channel_format(chat_template: str | None, vocab: Collection[str]) -> str:
    """The first channel format whose signature texts are all in the vocab or the chat
    template (`none` matches any)."""
    template = chat_template or ""
    return next(name for name, fmt in CHANNEL_FORMATS.items()
                if _found(fmt.signature, template, vocab))


def detect_tool_format(chat_template: str | None, vocab: Collection[str]) -> str:
    """The tool format tied to the model's channel format if one is (Harmony's, Kimi K3's
    XTML), else the first whose signature texts are all in the vocab or the template."""
    template = chat_template or ""
    channel_format = detect_channel_format(chat_template, vocab)
    for name, fmt in TOOL_FORMATS.items():
        if fmt.channel_format == channel_format:
            return name
    for name, fmt in TOOL_FORMATS.items():
        if fmt.signature and _found(fmt.signature, template, vocab):
            return name
    assert _FALLBACK.tools is not None  # `_checked` made sure
    return _FALLBACK.tools.name
