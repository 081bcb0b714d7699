"""Reasoning markup in `think_tags`' shape, which most families share: an open marker
starts reasoning, a close marker ends it, one reasoning block per turn, layout newlines
dropped. `THINK_TAGS` is the `<think>` ... `</think>` of Qwen3, DeepSeek, GLM, Kimi K2,
MiniMax-M2 and MiniCPM5; a family with other markers builds its own with
`tagged_reasoning` (LongCat, Solar, Gemma 4, Kimi K3). mlx-lm 0.32's `_infer_thinking`
is the reference for the markers.
"""

from __future__ import annotations

from replicas.contract import Channel
from replicas.families.channel_format import ChannelFormat, Rule, State

__all__ = ["THINK_TAGS", "tagged_reasoning"]


def tagged_reasoning(name: str, open_: str, close: str, *, signature: tuple[str, ...],
                     answer_drops: tuple[str, ...] = ()) -> ChannelFormat:
    """A `think_tags`-like format: `open_` starts reasoning, `close` (or "\\n" + close,
    the newline being layout) ends it; `answer_drops` are markers the answer swallows."""
    drops = tuple(Rule(m, "answer") for m in answer_drops)
    after = tuple(Rule(m, "answer_after") for m in answer_drops)
    return ChannelFormat(
        name=name,
        states={
            "answer": State(Channel.ANSWER, (Rule(open_, "reasoning"), *drops)),
            "reasoning": State(
                Channel.REASONING,
                (Rule(close, "answer_after"), Rule("\n" + close, "answer_after")),
                strip_leading_newlines=True,
            ),
            "answer_after": State(Channel.ANSWER, after, strip_leading_newlines=True),
        },
        answer_state="answer",
        reasoning_state="reasoning",
        reasoning_end=f"\n{close}\n\n" if not answer_drops else close,
        prompt_states=((open_, "reasoning"), (close, "answer_after")),
        signature=signature,
    )


# Qwen3 / DeepSeek-R1: "<think>\n" + reasoning + "\n</think>\n\n" + answer.
# - "\n</think>" is a marker next to "</think>": on a tie the longer match wins, so the one
#   newline before the closing tag is layout (held back while it could be), not reasoning.
# - Reasoning and the answer after it drop their leading newlines.
# - Once reasoning closed, "<think>" in the answer is literal text: only one block per turn.
# - An answer that starts the output keeps its leading newlines (raw completions need them).
THINK_TAGS = tagged_reasoning("think_tags", "<think>", "</think>",
                              signature=("<think>", "</think>"))
