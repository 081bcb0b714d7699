"""Drafts from a draft model: a small model sharing the target's tokenizer writes the next
few tokens, and the target verifies them in its batch pass like any draft
(`replicas.engine.spec.drafter`).

A greedy row's drafts are the draft model's argmax: deterministic guesses, checked by
"sample, then compare", so greedy output is the target's. An unseeded sampled row's drafts
are samples from the draft model's distribution under the row's own sampling shape, and
the target keeps them by the q/p rule (`replicas.engine.sampling.rejection`), which keeps the
target's distribution and keeps every draft of a draft that agrees with it. A seeded row
drafts greedily: "sample, then compare" draws each position with the key it would use
without speculation, so a seed gives the same text either way.

The draft model decodes as a batch beside the target's: one mlx-lm `BatchKVCache` per
layer, a row per target row (by uid). A step makes k drafts per row in k forwards. The
first brings every row to its sequence: the drafts the target rejected are dropped from
its cache, and what it kept plus its pending token are fed, all rows in one right-padded
forward whose padding is then dropped (`tails.drop_tails`, the verifying pass's own move);
its logits at each row's newest token give the first draft. Then k - 1
forwards of one token per row. A row new to the batch prefills its prompt alone, at most
`prefill_step` tokens a step across such rows, and drafts nothing until it is merged in
(the tokens it decoded meanwhile are fed by the next catch-up). Every row in the batch
drafts every step, even one whose grammar drafts for it or whose budget is spent, so no
row's cache falls behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from replicas.engine.config import SpeculativeConfig
from replicas.engine.request import common_prefix
from replicas.engine.sampling.samplers import SamplingShape
from replicas.engine.spec.drafter import Ask, Drafter
from replicas.engine.spec.tails import drop_tails


def check_draft_model(draft: nn.Module, draft_vocab: dict[str, int],
                      target_vocab: dict[str, int]) -> None:
    """Refuse a draft model whose tokens mean other things, or whose cache cannot drop
    rejected drafts."""
    if draft_vocab != target_vocab:
        raise ValueError("speculative.draft_model must share the model's tokenizer (its "
                         "vocabulary differs)")
    if not all(type(c) is KVCache for c in make_prompt_cache(draft)):
        raise ValueError("speculative.draft_model needs plain attention layers (its cache "
                         "must drop rejected drafts and batch: no sliding window or "
                         "recurrent layers)")


def write_drafts(uids: Sequence[int], logits: mx.array, asks: Sequence[Ask],
                 limits: Sequence[int], step: Callable[[mx.array], mx.array]
                 ) -> tuple[list[list[int]], dict[int, mx.array]]:
    """A drafter's tokens for its batch rows `uids`, from `logits` (each row's next
    logits), one column a step for the most any ask's limit allows; `step` feeds a column
    (B,) and returns the next logits. A greedy row takes the argmax, a sampled row (its
    ask has a shape) a sample under its own shape. The columns chain on the device and are
    read once at the end: a GPU waits for the host once a step, not once a draft. Returns
    each row's tokens, and the distributions each sampled row's first `limit` drafts were
    drawn from (q), by uid."""
    shapes = {a.uid: a.shape for a in asks}
    n_of = {a.uid: n for a, n in zip(asks, limits)}
    # Sampled rows by shape: rows alike draw in one go (a few ops a step, not per row).
    alike: dict[SamplingShape, list[int]] = {}
    for i, uid in enumerate(uids):
        if (shape := shapes.get(uid)) is not None:
            alike.setdefault(shape, []).append(i)
    at = [i for rows in alike.values() for i in rows]
    # Index arrays made once, not once a draft.
    where = mx.array(at)
    groups = [(shape, mx.array(rows)) for shape, rows in alike.items()]
    q: dict[int, list[mx.array]] = {i: [] for i in at}  # per sampled row, per step
    columns: list[mx.array] = []
    for n in range(max(limits, default=0)):
        if n:
            logits = step(columns[-1])
        tokens = mx.argmax(logits, axis=-1)
        if at:  # sampled rows draw from their own shape over the drafter's logits
            dists = mx.concatenate([shape.logprobs(logits[rows]) for shape, rows in groups])
            tokens[where] = mx.random.categorical(dists).astype(tokens.dtype)
            for i, dist in zip(at, dists):
                q[i].append(dist)
        columns.append(tokens)
    written = cast(list[list[int]], mx.stack(columns, axis=1).tolist()) if columns \
        else [[] for _ in uids]
    drawn = {uids[i]: mx.stack(of_row[:n_of[uids[i]]]) for i, of_row in q.items()
             if n_of.get(uids[i])}
    return written, drawn


class BatchDrafter(Drafter):
    """A drafter that writes every row's drafts at once, with a model's forwards (a draft
    model, an MTP layer): one row alone would be the whole batch."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._q: dict[int, mx.array] = {}  # the last drafts' distributions, sampled rows'

    def _propose(self, uid: int, history: Sequence[int], pending: int, limit: int
                 ) -> list[int]:
        raise NotImplementedError("this drafter drafts for the whole batch: draft_rows")

    def draft_rows(self, asks: Sequence[Ask]) -> list[list[int]]:
        self._q = {}
        limits = [max(0, self.limit(a.uid, a.budget)) for a in asks]
        if max(limits, default=0) == 0:
            return [[] for _ in asks]
        return self._draft_batch(asks, limits)

    def _draft_batch(self, asks: Sequence[Ask], limits: list[int]) -> list[list[int]]:
        """Each ask's draft, at most its limit (some limit is positive)."""
        raise NotImplementedError

    def sampled(self, uid: int) -> mx.array | None:
        return self._q.get(uid)


@dataclass
class _Join:
    """A row prefilling the draft model alone before it joins the batch."""

    tokens: list[int]  # what it prefills: its sequence when it asked first, less the newest
    cache: list[Any]
    done: int = 0


class ModelDrafter(BatchDrafter):
    """A draft model's drafts for the rows of one batch (engine thread only)."""

    def __init__(self, config: SpeculativeConfig, model: nn.Module, prefill_step: int) -> None:
        super().__init__(config)
        self._model = model
        self._prefill_step = prefill_step
        self._cache: list[Any] | None = None  # a BatchKVCache per layer, rows as `_uids`
        self._uids: list[int] = []
        self._fed: dict[int, list[int]] = {}  # the tokens each row's cache holds
        self._joining: dict[int, _Join] = {}  # rows whose tokens are still being prefilled

    def _draft_batch(self, asks: Sequence[Ask], limits: list[int]) -> list[list[int]]:
        sequences = {a.uid: [*a.history, a.pending] for a in asks}
        self._leave(sequences)
        self._prefill(sequences)
        if not self._uids:  # every row is still joining
            return [[] for _ in asks]
        logits = self._catch_up([sequences[uid] for uid in self._uids])
        assert self._cache is not None
        cache = self._cache
        written, self._q = write_drafts(
            self._uids, logits, asks, limits,
            lambda column: self._model(column[:, None], cache=cache)[:, -1, :])
        for uid, tokens_of in zip(self._uids, written):
            self._fed[uid] = sequences[uid] + tokens_of[:-1]  # the last was never fed
        at = {uid: i for i, uid in enumerate(self._uids)}
        return [written[at[a.uid]][:n] if a.uid in at else [] for a, n in zip(asks, limits)]

    def _leave(self, sequences: dict[int, list[int]]) -> None:
        """Rows no longer asked about leave the batch (rows that left the target's batch
        go here, at the next draft, not at `keep`)."""
        keep = [i for i, uid in enumerate(self._uids) if uid in sequences]
        if len(keep) < len(self._uids):
            self._uids = [self._uids[i] for i in keep]
            if not keep:
                self._cache = None
            for layer in self._cache or ():
                layer.filter(keep)
        for uid in [u for u in self._fed if u not in sequences]:
            del self._fed[uid]
        for uid in [u for u in self._joining if u not in sequences]:
            del self._joining[uid]

    def _catch_up(self, targets: list[list[int]]) -> mx.array:
        """Every row brought to its whole sequence in one forward: rejected drafts dropped
        out, what it kept and its pending token fed. Returns each row's next logits."""
        assert self._cache is not None
        # At least the newest token is fed: its logits start the drafts.
        shared = [min(common_prefix(self._fed[uid], want), len(want) - 1)
                  for uid, want in zip(self._uids, targets)]
        drop = [len(self._fed[uid]) - n for uid, n in zip(self._uids, shared)]
        if any(drop):
            drop_tails(self._cache, drop)
        feed = [want[n:] for want, n in zip(targets, shared)]
        width = max(len(f) for f in feed)
        logits = self._model(mx.array([f + [0] * (width - len(f)) for f in feed]),
                             cache=self._cache)
        last = logits[mx.arange(len(feed)), mx.array([len(f) - 1 for f in feed])]
        drop_tails(self._cache, [width - len(f) for f in feed])
        for uid, want in zip(self._uids, targets):
            self._fed[uid] = want
        return last

    def _prefill(self, sequences: dict[int, list[int]]) -> None:
        """Rows new to the batch prefill their tokens alone, `prefill_step` tokens a step
        in all (as the model's own prompts do), so a long prompt never stalls the batch
        for long; a row drafts nothing until its prefill is done and it is merged in."""
        for uid in sequences:
            if uid not in self._fed and uid not in self._joining:
                self._joining[uid] = _Join(sequences[uid][:-1], make_prompt_cache(self._model))
        budget = self._prefill_step
        for uid, join in list(self._joining.items()):
            if budget <= 0:
                return
            chunk = join.tokens[join.done:join.done + budget]
            if chunk:
                self._model(mx.array([chunk]), cache=join.cache)
                mx.eval([c.state for c in join.cache])
            join.done += len(chunk)
            budget -= len(chunk)
            if join.done == len(join.tokens):
                del self._joining[uid]
                self._join(uid, join.tokens, join.cache)

    def _join(self, uid: int, tokens: list[int], cache: list[Any]) -> None:
        """A row whose tokens `cache` holds, merged into the batch."""
        merged = [BatchKVCache.merge([layer]) for layer in cache]
        if self._cache is None:
            self._cache = merged
        else:
            for mine, new in zip(self._cache, merged):
                mine.extend(new)
        self._uids.append(uid)
        self._fed[uid] = list(tokens)
