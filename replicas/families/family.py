"""`Family`: one model family as Orchard reads it, and `ModelTemplate`, what the family's
built-in test model (`builtin:fmt-<tool format>`) is made of.

Each family module exports its `Family` value; `registry.py` lists them in the one
detection order. Pure data: nothing here knows the router, the parser or the builder.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.families.channel_format import ChannelFormat
from replicas.families.tool_format import Syntax, ToolFormat

__all__ = ["Family", "ModelTemplate"]


@dataclass(frozen=True)
class ModelTemplate:
    """The tokenizer layout and chat template of a family's test model: a real checkpoint's
    added tokens and template, cut down to tool calling (`replicas/builtin/family_models.py`
    builds the model with random weights)."""

    chat_template: str
    special: tuple[str, ...]  # added special tokens (pad, eos, bos, role markers, ...)
    eos: tuple[str, ...]  # the end-of-turn tokens; the first is the tokenizer's eos_token
    pad: str
    # The call markers the random head favours, so the free choices a forced call's
    # grammar leaves (Kimi's call index, Harmony's analysis) end at once.
    favoured: tuple[str, ...]
    # The random weights' seed, as an offset from the builder's base seed: fixed per family
    # (never reused), so adding or reordering families leaves every model as it was.
    seed: int
    plain: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>)
    bos: str | None = None

    @property
    def added(self) -> tuple[str, ...]:
        return (*self.special, *self.plain)


@dataclass(frozen=True)
class Family:
    """What Orchard knows of one model family's output markup.

    `reasoning`: its channel format (None: no reasoning markup, so the answer is all text);
    `tools`: its tool format (None: no call markup Orchard reads); each carries the
    `signature` the family is detected by. `template`: its built-in test model, one per
    family that has calls.
    """

    name: str
    reasoning: ChannelFormat | None = None
    tools: ToolFormat | None = None
    template: ModelTemplate | None = None

    def __post_init__(self) -> None:
        calls = self.tools is not None and self.tools.syntax is not Syntax.NONE
        if self.template is not None and not calls:
            raise ValueError(f"family {self.name!r}: a test model needs calls to test")
        # A tool format tied to a channel format (Harmony's calls) is that family's own.
        tied = self.tools.channel_format if self.tools is not None else None
        if tied is not None and (self.reasoning is None or self.reasoning.name != tied):
            raise ValueError(f"family {self.name!r}: its calls go with channel format {tied!r}")
