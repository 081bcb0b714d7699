"""The reasoning markup of the families whose thinking is not `<think>` tags, as channel
formats (registered in `channels.FORMATS`). mlx-lm 0.32's `_infer_thinking` is the
reference for the markers; `_infer_structural_markers` for Kimi K3's answer wrapper.

Each is `think_tags`' shape with other markers: an open marker starts reasoning, a close
marker ends it, one reasoning block per turn, layout newlines dropped.
"""

from __future__ import annotations

from replicas.contract import Channel
from replicas.pipeline.channel_formats import ChannelFormat, Rule, State

__all__ = ["GEMMA4_THOUGHT", "LONGCAT_THINK", "THINK_COLON", "XTML", "tagged_reasoning"]


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


# Meituan LongCat: `<longcat_think>` ... `</longcat_think>`.
LONGCAT_THINK = tagged_reasoning("longcat_think", "<longcat_think>", "</longcat_think>",
                                 signature=("<longcat_think>", "</longcat_think>"))
# The third single-token pair mlx-lm knows.
THINK_COLON = tagged_reasoning("think_colon", "<|think:start|>", "<|think:end|>",
                               signature=("<|think:start|>", "<|think:end|>"))
# Gemma 4: `<|channel>thought\n` + reasoning + `<channel|>` + answer. `thought` is the only
# channel mlx-lm opens; the whole text is the marker, so another channel stays text.
GEMMA4_THOUGHT = tagged_reasoning("gemma4", "<|channel>thought", "<channel|>",
                                  signature=("<|channel>", "<channel|>"))
# Kimi K3's XTML: `<|open|>think<|sep|>` ... `<|close|>think<|sep|>`, the answer wrapped in
# `<|open|>response<|sep|>` ... `<|close|>response<|sep|>` and the message closed by
# `<|close|>message<|sep|>`: the answer drops those three, as mlx-lm does.
XTML = tagged_reasoning(
    "xtml", "<|open|>think<|sep|>", "<|close|>think<|sep|>",
    signature=("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    answer_drops=("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                  "<|close|>message<|sep|>"),
)
