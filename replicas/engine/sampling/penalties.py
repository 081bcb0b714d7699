"""`logit_bias` and the repetition, presence and frequency penalties, for a whole batch at once.

mlx-lm's `GenerationBatch` runs any row's logits processors in a Python loop, one row at a
time, so a single biased request takes the whole batch off its one-call path. These are the
same four adjustments as `mlx_lm.sample_utils.make_logits_processors` (same order, same
arithmetic), but as data: a `Penalties` per row, applied to every row of a step in a few
array operations (`apply`). A `Penalties` is also a plain per-row processor, for the one
place mlx-lm still calls processors itself (a row's first token, in its prefill batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from replicas.contract import SamplingParams

# mlx-lm's penalty processors look back over a window; vLLM looks at the whole output.
# 256 tokens covers typical answers while keeping the per-step cost bounded.
PENALTY_CONTEXT = 256


@dataclass(frozen=True)
class Penalties:
    """One row's bias and penalties; neutral values change nothing."""

    bias: tuple[tuple[int, float], ...] = ()
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    @classmethod
    def of(cls, params: SamplingParams) -> Penalties | None:
        """The request's, or None when it has none."""
        penalties = cls(tuple(sorted(params.logit_bias.items())), params.repetition_penalty,
                        params.presence_penalty, params.frequency_penalty)
        return penalties if penalties != cls() else None

    @property
    def looks_back(self) -> bool:
        """Whether it reads the tokens before (bias alone does not)."""
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """As a per-row processor (mlx-lm's signature): `logits` is (1, vocab)."""
        window = tokens[-PENALTY_CONTEXT:].tolist() if tokens.size else []
        return apply(logits, [self], [list(window)])  # type: ignore[arg-type]


Window = tuple[mx.array, mx.array]  # (n, width) token ids, and 1.0 where a token is real


def apply(logits: mx.array, rows: Sequence[Penalties | None],
          contexts: Sequence[Sequence[int]] | Window | None) -> mx.array:
    """`logits` (n, vocab) with row i's `rows[i]` applied. `contexts` holds each row's
    tokens so far (only the last `PENALTY_CONTEXT` count), as lists or as a `window`; it
    may be None when no row looks back."""
    if not any(rows):
        return logits
    n = logits.shape[0]
    at = mx.arange(n)[:, None]
    biased = [p.bias if p else () for p in rows]
    if any(biased):
        width = max(len(b) for b in biased)
        # Padding adds 0.0 to token 0: a no-op, and it keeps the scatter rectangular.
        ids = mx.array([[t for t, _ in b] + [0] * (width - len(b)) for b in biased])
        values = mx.array([[v for _, v in b] + [0.0] * (width - len(b)) for b in biased])
        logits = logits.at[at, ids].add(values.astype(logits.dtype))
    if not any(p and p.looks_back for p in rows):
        return logits
    assert contexts is not None, "penalties that look back need the rows' tokens"
    ids, valid = contexts if isinstance(contexts, tuple) else window(contexts)
    neutral = Penalties()
    repetition = mx.array([(p or neutral).repetition for p in rows])[:, None]
    presence = mx.array([(p or neutral).presence for p in rows])[:, None]
    frequency = mx.array([(p or neutral).frequency for p in rows])[:, None]
    # Padding repeats a token already in the row's window, so setting it twice writes the
    # same value; the frequency count below skips it through `valid`.
    picked = mx.take_along_axis(logits, ids, axis=1)
    picked = mx.where(picked < 0, picked * repetition, picked / repetition)
    logits = mx.put_along_axis(logits, ids, picked.astype(logits.dtype), axis=1)
    picked = mx.take_along_axis(logits, ids, axis=1) - presence
    logits = mx.put_along_axis(logits, ids, picked.astype(logits.dtype), axis=1)
    return logits.at[at, ids].add((-frequency * valid).astype(logits.dtype))


def window(contexts: Sequence[Sequence[int]], last: mx.array | None = None) -> Window:
    """Each row's last `PENALTY_CONTEXT` tokens as one (n, width) array: `contexts[i]`, then
    `last[i]` when given (a step's input, still being computed: no wait for it). Short rows
    are left-padded with a copy of their newest token, whose mask is 0."""
    keep = PENALTY_CONTEXT - (last is not None)
    tails = [list(c[-keep:]) if keep else [] for c in contexts]
    assert last is not None or all(tails), "every row holds at least one token"
    width = max(len(t) for t in tails)
    ids = mx.array([[-1] * (width - len(t)) + t for t in tails], dtype=mx.int32)
    valid = mx.array([[0.0] * (width - len(t)) + [1.0] * len(t) for t in tails])
    if last is not None:
        ids = mx.concatenate([ids, last.astype(mx.int32)[:, None]], axis=1)
        valid = mx.concatenate([valid, mx.ones((len(tails), 1))], axis=1)
    newest = ids[:, -1:]
    return mx.where(ids < 0, newest, ids), valid
