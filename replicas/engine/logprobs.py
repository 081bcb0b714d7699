"""Token logprobs for the requests that ask for them (OpenAI `logprobs` / `top_logprobs`).

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
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from replicas.contract import (
    Channel,
    Finished,
    OutputEvent,
    TextDelta,
    TokenLogprob,
)
from replicas.pipeline.detokenizer import Decode

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat `top_logprobs`
# JSON has no -inf: a token a mask ruled out is reported with OpenAI's floor value.
FLOOR = -9999.0


@dataclass(frozen=True)
class Asked:
    """One row of a step whose request wants logprobs."""

    uid: int
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
    """Each row's token logprob and its top alternatives, by uid, in one batched pass."""
    if not rows:
        return {}
    lp = mx.stack([r.logprobs for r in rows]).astype(mx.float32)
    inv = mx.array([1.0 / r.temperature if r.temperature > 0 else 1.0 for r in rows])
    scaled = lp * inv[:, None]
    scaled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    picked = top_of(scaled, [r.token for r in rows], max(r.top for r in rows))
    return {r.uid: dataclasses.replace(p, top=p.top[:r.top]) for r, p in zip(rows, picked)}


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


class TokenPieces:
    """Each id's text as one token (special tokens kept), cached: top-k lookups repeat the
    same few ids. Shared by a model's requests; the lock makes it safe off the engine thread."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._pieces: dict[int, str] = {}
        self._lock = threading.Lock()

    def __call__(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._decode([token_id])
            with self._lock:
                if len(self._pieces) > 1 << 18:  # bounded: a huge vocab swept by top-k
                    self._pieces.clear()
                self._pieces[token_id] = piece
        return piece


class LogprobTrail:
    """One request's logprob entries on their way out: each token's entry rides with the
    first text the pipeline emits at or after it (a held token waits for its text), and
    what is left at the end rides in an empty answer delta before `Finished`."""

    def __init__(self, top: int, pieces: TokenPieces) -> None:
        self.top = top
        self._pieces = pieces
        self._pending: list[TokenLogprob] = []

    def piece(self, token_id: int) -> str:
        return self._pieces(token_id)

    def entry(self, token_id: int, picked: Picked) -> TokenLogprob:
        piece = self._pieces
        return TokenLogprob(piece(token_id), token_id, picked.logprob,
                            tuple((piece(i), v) for i, v in picked.top))

    def on_token(self, events: list[OutputEvent], picked: dict[int, Picked] | None,
                 response: Any) -> list[OutputEvent]:
        """One token's events (mlx-lm's `response`) with the entries they carry."""
        if picked is None or response.uid not in picked:
            raise RuntimeError("no logprobs for this step")  # fails this request alone
        # An EOS or stop token id ends the turn and is no text: it has no entry (as OpenAI).
        if response.finish_reason == "stop":
            return self.attach(events, None)
        return self.attach(events, self.entry(response.token, picked[response.uid]))

    def attach(self, events: list[OutputEvent], entry: TokenLogprob | None) -> list[OutputEvent]:
        """`events` (one token's) with the pending entries on their first text; `entry`:
        this token's, None for a token that is not text (EOS, a stop token id)."""
        if entry is not None:
            self._pending.append(entry)
        if not self._pending:
            return events
        for i, event in enumerate(events):
            if isinstance(event, TextDelta) and event.text:
                out = list(events)
                out[i] = dataclasses.replace(event, logprobs=tuple(self._pending))
                self._pending = []
                return out
        if events and isinstance(events[-1], Finished):
            tail = TextDelta(Channel.ANSWER, "", tuple(self._pending))
            self._pending = []
            return [*events[:-1], tail, events[-1]]
        return events
