"""Token logprobs for the requests that ask for them (OpenAI `logprobs` / `top_logprobs`):
the arithmetic. Each number's text and where it rides out is the pipeline's
(`replicas.pipeline.logprob_trail`).


mlx-lm's batch responses carry, per row, the log-softmax of the logits after the row's
logits processors (penalties, logit bias, the controller's grammar mask and bans) and
before its sampler. The sampler then divides by the temperature (and may cut the tail with
top_p / top_k / min_p), so the numbers reported here are the tempered distribution:
log_softmax(logprobs / T), or the processed distribution itself when T is 0 (greedy).
The tail cuts are not applied: the numbers are the distribution they cut from.

Cost: nothing for a step without such rows; otherwise one stacked computation and one
`.tolist()` per step for all the rows that asked, never a Python loop over the vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx


MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat `top_logprobs`
# JSON has no -inf: a token a mask ruled out is reported with OpenAI's floor value.
FLOOR = -9999.0


@dataclass(frozen=True)
class Asked:
    """One row of a step whose request wants logprobs."""

    at: int  # the caller's key for it
    token: int
    logprobs: mx.array  # (vocab,) the row's processed log-softmax, from mlx-lm
    temperature: float
    top: int


@dataclass(frozen=True)
class Picked:
    """The numbers for one row's token; `top` is (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def pick(rows: Sequence[Asked]) -> dict[int, Picked]:
    """Each row's token logprob and its top alternatives, by its `at`, in one pass."""
    if not rows:
        return {}
    lp = mx.stack([r.logprobs for r in rows]).astype(mx.float32)
    inv = mx.array([1.0 / r.temperature if r.temperature > 0 else 1.0 for r in rows])
    scaled = lp * inv[:, None]
    scaled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    picked = top_of(scaled, [r.token for r in rows], max(r.top for r in rows))
    return {r.at: dataclasses.replace(p, top=p.top[:r.top]) for r, p in zip(rows, picked)}


def top_of(logprobs: mx.array, tokens: Sequence[int], top: int) -> list[Picked]:
    """Row i's logprob of `tokens[i]` and its `top` best alternatives; `logprobs` is
    (rows, vocab), normalized. One evaluation and one `.tolist()` for all rows."""
    chosen = mx.take_along_axis(logprobs, mx.array([[t] for t in tokens]), axis=-1)[:, 0]
    k = min(top, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k] if k > 0 \
        else mx.zeros((len(tokens), 0), dtype=mx.int32)
    values = mx.take_along_axis(logprobs, ids, axis=-1) if k > 0 else ids.astype(mx.float32)
    mx.eval(chosen, ids, values)
    chosen_l: list[float] = chosen.tolist()  # type: ignore[assignment]
    ids_l: list[list[int]] = ids.tolist()  # type: ignore[assignment]
    values_l: list[list[float]] = values.tolist()  # type: ignore[assignment]
    out: list[Picked] = []
    for value, row_ids, row_values in zip(chosen_l, ids_l, values_l):
        best = sorted(zip(row_ids, row_values), key=lambda p: -p[1])
        out.append(Picked(_finite(value), tuple((i, _finite(v)) for i, v in best)))
    return out


def _finite(value: float) -> float:
    return value if value > FLOOR else FLOOR
