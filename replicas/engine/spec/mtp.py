"""Drafts from the model's own MTP layer (`speculative.method: mtp`, `replicas.engine.model.mtp`).

The layer reads the model's last hidden state at a position and the token that followed,
so it drafts from what the model's own passes leave behind: every target pass
(`replicas.engine.batch.decode`) hands over, per row, the hidden states of the positions it
kept and the tokens that followed them (`saw`). A step's drafts then cost one forward of
the layer that feeds those pairs, all rows right-padded together (its logits at each
row's newest pair give the first draft), and k - 1 one-position forwards where each
draft's layer output stands in for the hidden state the model has not computed yet.

Those chained positions are guesses, so they leave the layer's cache before the next
step's pairs come in. The cache holds a row's pairs from its first pass in this batch on:
the layer does not see the prompt (mlx-lm's prefill keeps no hidden states, and a prefix
cache hit computes none), only the model's hidden state, which does. Verification keeps
the output exact either way; only how many drafts are kept depends on it.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from replicas.engine.config import SpeculativeConfig
from replicas.engine.spec.draft_model import BatchDrafter, write_drafts
from replicas.engine.model.mtp import Mtp
from replicas.engine.spec.drafter import Ask
from replicas.engine.spec.tails import drop_tails

# Pairs a row may have waiting (a row not drafting for long: a large batch under
# `disable_by_batch_size`); past this it starts over from its newest pairs.
_MAX_WAITING = 64


class MtpDrafter(BatchDrafter):
    """MTP drafts for the rows of one batch (engine thread only)."""

    wants_hidden = True

    def __init__(self, config: SpeculativeConfig, mtp: Mtp) -> None:
        super().__init__(config)
        self._mtp = mtp
        self._cache: Any = None  # the layer's BatchKVCache, rows as `_uids`
        self._uids: list[int] = []
        self._chained = 0  # guessed positions at the end of every row's cache
        # Per row: the (hidden states, following tokens) pairs not yet fed, oldest first.
        self._waiting: dict[int, list[tuple[mx.array, mx.array]]] = {}
        self._fresh: dict[int, bool] = {}  # this step: rows with pairs fed, by uid

    def saw(self, uids: Sequence[int], hidden: mx.array, following: mx.array,
            counts: Sequence[int]) -> None:
        """A target pass over `uids`: row i's first counts[i] positions were kept, with
        hidden states hidden[i] (W, H) and the tokens that followed them following[i]."""
        for i, (uid, n) in enumerate(zip(uids, counts)):
            waiting = self._waiting.setdefault(uid, [])
            waiting.append((hidden[i, :n], following[i, :n].astype(mx.int32)))
            if sum(h.shape[0] for h, _ in waiting) > _MAX_WAITING:
                self._restart(uid)

    def _draft_batch(self, asks: Sequence[Ask], limits: list[int]) -> list[list[int]]:
        self.keep([a.uid for a in asks])
        if self._chained:
            drop_tails([self._cache], [self._chained] * len(self._uids))
            self._chained = 0
        outs = self._catch_up()
        if outs is None:
            return [[] for _ in asks]
        mtp, at = self._mtp, {uid: i for i, uid in enumerate(self._uids)}
        state = {"out": outs}

        def step(column: mx.array) -> mx.array:
            state["out"] = mtp.layer(state["out"], mtp.embed(column[:, None]), self._cache)
            self._chained += 1
            return mtp.logits(state["out"])[:, -1, :]

        # Rows with nothing fed this step (none in practice) draft nothing.
        limits = [n if self._fresh.get(a.uid) else 0 for a, n in zip(asks, limits)]
        written, self._q = write_drafts(self._uids, mtp.logits(outs)[:, -1, :], asks, limits,
                                        step)
        return [written[at[a.uid]][:n] if a.uid in at else [] for a, n in zip(asks, limits)]

    def keep(self, uids: Sequence[int]) -> None:
        super().keep(uids)
        live = set(uids)
        self._leave([uid for uid in self._uids if uid not in live])
        for uid in [u for u in self._waiting if u not in live]:
            del self._waiting[uid]

    def _leave(self, gone: Sequence[int]) -> None:
        """Rows out of the layer's batch."""
        keep = [i for i, uid in enumerate(self._uids) if uid not in gone]
        if len(keep) == len(self._uids):
            return
        self._uids = [self._uids[i] for i in keep]
        if keep:
            self._cache.filter(keep)
        else:
            self._cache, self._chained = None, 0

    def _restart(self, uid: int) -> None:
        """Row `uid` leaves the layer's batch and starts again from its newest pairs."""
        self._leave([uid])
        self._waiting[uid] = self._waiting[uid][-1:]

    def _catch_up(self) -> mx.array | None:
        """Every row's waiting pairs fed: the batch's rows in one right-padded forward,
        rows new to it alone, then merged in. Returns the layer's output (B, 1, H) at each
        row's newest pair, rows as `_uids`; None when no row has any."""
        mtp = self._mtp
        self._fresh = {uid: bool(self._waiting.get(uid)) for uid in self._uids}
        outs: list[mx.array] = []
        if self._uids:
            pairs = [self._take(uid) for uid in self._uids]
            width = max(1, max(h.shape[0] for h, _ in pairs))
            hidden = mx.stack([_pad(h, width) for h, _ in pairs])
            tokens = mx.stack([_pad(t, width) for _, t in pairs])
            out = mtp.layer(hidden, mtp.embed(tokens), self._cache)
            last = mx.array([max(0, h.shape[0] - 1) for h, _ in pairs])
            outs.append(out[mx.arange(len(pairs)), last][:, None])
            drop_tails([self._cache], [width - h.shape[0] for h, _ in pairs])
        for uid in [u for u, w in self._waiting.items() if w and u not in self._fresh]:
            hidden, tokens = self._take(uid)
            cache = mtp.make_cache()
            out = mtp.layer(hidden[None], mtp.embed(tokens[None]), cache[0])
            outs.append(out[:, -1:])
            merged = BatchKVCache.merge(cache)
            if self._cache is None:
                self._cache = merged
            else:
                self._cache.extend(merged)
            self._uids.append(uid)
            self._fresh[uid] = True
        return mx.concatenate(outs) if outs else None

    def _take(self, uid: int) -> tuple[mx.array, mx.array]:
        """Row `uid`'s waiting pairs, as one (N, H) and one (N,), and none left waiting."""
        waiting = self._waiting.pop(uid, [])
        if not waiting:
            weight = self._mtp.layer.enorm.weight
            return mx.zeros((0, weight.shape[0]), weight.dtype), mx.zeros((0,), mx.int32)
        return (mx.concatenate([h for h, _ in waiting]),
                mx.concatenate([t for _, t in waiting]))


def _pad(x: mx.array, width: int) -> mx.array:
    """`x` (N, ...) right-padded with zeros to `width` rows."""
    if x.shape[0] == width:
        return x
    return mx.concatenate([x, mx.zeros((width - x.shape[0], *x.shape[1:]), dtype=x.dtype)])
