"""Drafts from a draft model: a small model sharing the target's tokenizer writes the next
few tokens greedily, and the target verifies them in its batch pass like any draft
(`replicas.engine.speculation`).

Greedy drafts are deterministic guesses, so the verification stays exact for every
sampler ("sample, then compare"): greedy output is the target's, sampled output keeps the
target's distribution. Drafting the draft model's own samples with the q/p acceptance rule
would keep more drafts under sampling; that is not done here.

Each row keeps its own draft cache (mlx-lm's, as `make_prompt_cache` builds it) and the
tokens it holds. A step trims the cache back to what the row's history still shares with
it (rejected drafts), feeds the rest (the prompt once, then the kept drafts and the new
pending token), and writes up to `limit` tokens, one forward each. Rows draft one after
another: a draft model is small, and one stream (where drafting pays) is one row. A long
prompt's first draft prefills the draft model over it, in `prefill_step` chunks, inside
that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from replicas.engine.config import SpeculativeConfig
from replicas.engine.speculation import Drafter


@dataclass
class _Row:
    cache: list[Any]
    fed: list[int] = field(default_factory=list)  # the tokens `cache` holds


def check_draft_model(draft: nn.Module, draft_vocab: dict[str, int],
                      target_vocab: dict[str, int]) -> None:
    """Refuse a draft model whose tokens mean other things, or whose cache cannot drop
    rejected drafts."""
    if draft_vocab != target_vocab:
        raise ValueError("speculative.draft_model must share the model's tokenizer (its "
                         "vocabulary differs)")
    if not can_trim_prompt_cache(make_prompt_cache(draft)):
        raise ValueError("speculative.draft_model's cache cannot drop rejected drafts "
                         "(sliding window or recurrent layers)")


class ModelDrafter(Drafter):
    """A draft model's greedy drafts for the rows of one batch (engine thread only)."""

    def __init__(self, config: SpeculativeConfig, model: nn.Module, prefill_step: int) -> None:
        super().__init__(config)
        self._model = model
        self._prefill_step = prefill_step
        self._rows: dict[int, _Row] = {}

    def _propose(self, uid: int, history: Sequence[int], pending: int, limit: int
                 ) -> list[int]:
        if limit <= 0:
            return []
        row = self._rows.get(uid)
        if row is None:
            row = self._rows[uid] = _Row(make_prompt_cache(self._model))
        sequence = [*history, pending]
        shared = _common(row.fed, sequence)
        if shared == len(sequence):  # nothing new to feed: re-feed the newest token
            shared -= 1
        if shared < len(row.fed):
            trim_prompt_cache(row.cache, len(row.fed) - shared)
        logits = self._feed(sequence[shared:], row.cache)
        drafts: list[int] = []
        while True:
            token = cast(int, mx.argmax(logits, axis=-1).item())
            drafts.append(token)
            if len(drafts) == limit:
                break
            logits = self._feed([token], row.cache)
        row.fed = sequence + drafts[:-1]  # the last draft was never fed
        return drafts

    def _feed(self, tokens: list[int], cache: list[Any]) -> mx.array:
        """The draft model over `tokens` (chunked): the last position's logits."""
        for start in range(0, len(tokens), self._prefill_step):
            chunk = tokens[start:start + self._prefill_step]
            logits = self._model(mx.array([chunk]), cache=cache)
            mx.eval([c.state for c in cache])
        return logits[0, -1]

    def keep(self, uids: Sequence[int]) -> None:
        super().keep(uids)
        live = set(uids)
        for uid in [u for u in self._rows if u not in live]:
            del self._rows[uid]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
