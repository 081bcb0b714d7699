"""`FormatSpec`: what a tool-format model's tokenizer and chat template are made of
(`formats.py` builds the model; `format_templates*.py` hold one entry per family).

Kept apart from the entries so every family's module imports it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FormatSpec"]


@dataclass(frozen=True)
class FormatSpec:
    """A tool-format model's tokenizer and template; `tool_format` is what Orchard must
    detect from them (a name in `replicas.pipeline.tool_formats.TOOL_FORMATS`)."""

    tool_format: str
    template: str
    special: tuple[str, ...]  # added special tokens (pad, eos, bos, role markers, ...)
    eos: tuple[str, ...]  # the end-of-turn tokens; the first is the tokenizer's eos_token
    pad: str
    # The call markers the random head favours (`formats.py`), so the free choices a
    # forced call's grammar leaves (Kimi's call index, Harmony's analysis) end at once.
    favoured: tuple[str, ...]
    plain: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>)
    bos: str | None = None

    @property
    def added(self) -> tuple[str, ...]:
        return (*self.special, *self.plain)
