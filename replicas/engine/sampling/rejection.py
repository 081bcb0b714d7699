"""The q/p rule: keeping sampled drafts so that the output keeps the target's distribution.

A draft model samples each draft d from its own distribution q (under the row's sampling
shape). The target keeps d with probability min(1, p(d) / q(d)); at the first draft it
rejects, it emits a token drawn from the residual max(p - q, 0), renormalized, and the
pass ends there. Where every draft was kept, the target's own draw at the next position
follows. Each emitted token is then distributed as p exactly (Leviathan et al., 2023), and
a draft that agrees with the target (q = p) is always kept: "sample, then compare", which
greedy and prompt-lookup drafts use, keeps a sampled draft only where the target happens
to sample the same token.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


def judge(p: mx.array, q: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Rows of drafts judged, lazily: `p` (rows, n, V) is the target's log distribution at
    each draft's position, `q` (rows, n, V) the draft's, `drafts` (rows, n) the tokens.
    Returns whether each draft is kept, and the token a rejection there emits."""
    p_d = mx.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keep = mx.log(mx.random.uniform(shape=drafts.shape)) < p_d - q_d
    residual = mx.maximum(mx.exp(p) - mx.exp(q), 0.0)
    # Where q covers p (q = p up to rounding), nothing is left: a rejection there, which
    # only rounding makes, draws from p itself.
    left = residual.sum(axis=-1, keepdims=True) > 0
    fix = mx.random.categorical(mx.where(left, mx.log(residual), p))
    return keep, fix


def verdict(keep: Sequence[bool], fix: Sequence[int], final: int) -> tuple[int, int]:
    """One row's drafts kept and the token that follows them: the residual's draw at the
    first rejection, else `final`, the target's draw after the last draft."""
    for j, kept in enumerate(keep):
        if not kept:
            return j, fix[j]
    return len(keep), final


def accepted(drafts: Sequence[Sequence[int]], sampled: Sequence[Sequence[int]]) -> list[int]:
    """Per row, how many leading drafts the target sampled too."""
    kept = []
    for draft, target in zip(drafts, sampled):
        n = 0
        while n < len(draft) and target[n] == draft[n]:
            n += 1
        kept.append(n)
    return kept
