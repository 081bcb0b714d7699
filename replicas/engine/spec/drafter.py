"""Speculative decoding inside the batch: drafts per row, and what a verifying pass keeps.

Each step, every row that may speculate proposes up to k tokens after its pending one
(`replicas.engine.spec.ngram`). One target pass runs all rows over their pending token and
drafts (right-padded to the longest), the target samples every position with the row's
own sampler, and a row keeps its drafts up to the first one the target did not sample,
plus the target's token there. Drafts are deterministic guesses, so "sample, then compare"
is exactly rejection sampling: a draft d is kept with probability p(d), and on a miss the
target's token is a draw from p without d. Greedy output is the output without
speculation, and seeded samplers draw position j with the key of the j-th next token.

The rows' rejected positions leave the batch cache by `replicas.engine.spec.tails.drop_tails`:
trimmed where all rows rejected as many, and a row's excess filled with its oldest slots
(a few slots moved, never the row's whole cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from replicas.engine.config import SpeculativeConfig
from replicas.engine.spec.ngram import NgramIndex
from replicas.engine.kv.layout import leaves
from replicas.engine.model.mla import has_sparse_indexer
from replicas.engine.sampling.samplers import SamplingShape


class Ask(NamedTuple):
    """One row's ask for a draft, as `Drafter.draft` takes it, plus how the row samples."""

    uid: int
    history: Sequence[int]
    pending: int
    budget: int
    # A sampled row's distribution: a draft model samples its drafts from it, for the q/p
    # rule (`replicas.engine.sampling.rejection`). None: drafts are guesses (greedy).
    shape: SamplingShape | None = None


# A row whose drafts nearly all missed rests, drafting one token every this many steps.
PROBE_EVERY = 8


@dataclass
class DecodeStats:
    """Counters of one batch's decoding, read for metrics (engine thread only)."""

    # Rows' decoding passes: each target forward (plain or verifying) counts once per row
    # in it, so tokens / passes is the tokens a sequence gets per pass, batch or not.
    passes: int = 0
    tokens: int = 0  # tokens emitted
    drafted: int = 0  # draft tokens verified
    forced: int = 0  # of those, drafts a row's grammar forced (grammar fast-forward)
    accepted: int = 0  # draft tokens kept and emitted (not those past a row's end)
    rows_off_path: int = 0  # row-steps whose logits went through a per-row Python call


def can_roll_back(model: nn.Module) -> bool:
    """Whether every layer's cache can drop a row's rejected positions: plain attention
    KV can (a `CacheList` of it too: LongCat's); a sliding window that wrapped, or a
    recurrent state (SSM, linear attention) cannot, and such models decode one token per
    pass. So does a sparse indexer's (DeepSeek V3.2, GLM-5): its top-k breaks ties (ReLU'd
    scores of 0) by slot, and a dropped tail moves a row's slots (`tails`)."""
    return not has_sparse_indexer(model) and \
        all(type(c) is KVCache for c in leaves(make_prompt_cache(model)))


class Drafter:
    """Prompt-lookup drafts for the rows of one batch, an index per row (by uid)."""

    # Whether it drafts from the model's hidden states (MTP): the batch then runs the
    # model's forward split there and hands them over (`saw`).
    wants_hidden = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indices: dict[int, NgramIndex] = {}
        # Each row's recent share of drafts kept: a row whose guesses miss drafts fewer,
        # since every drafted position costs compute whether it is kept or not.
        self._kept: dict[int, float] = {}
        self._rested: dict[int, int] = {}  # steps each resting row has not drafted

    def active(self, rows: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or rows <= limit

    def draft_rows(self, asks: Sequence[Ask]) -> list[list[int]]:
        """Each row's draft (a draft model writes them for all rows at once)."""
        return [self.draft(a.uid, a.history, a.pending, a.budget) for a in asks]

    def sampled(self, uid: int) -> mx.array | None:
        """The distribution (n, V) row `uid`'s last n drafts were sampled from, if they
        were (a draft model's, for a sampled row); None for guesses."""
        return None

    def draft(self, uid: int, history: Sequence[int], pending: int, budget: int) -> list[int]:
        """Row `uid`'s draft after `pending`: `history` is what its cache holds (it only
        ever grows by what was kept), `budget` the most tokens it may still emit after
        `pending`."""
        return self._propose(uid, history, pending, self.limit(uid, budget))

    def limit(self, uid: int, budget: int) -> int:
        """How many tokens row `uid` drafts now, at most `budget`: fewer where its recent
        drafts missed, and none where nearly all did, but for one every `PROBE_EVERY`
        steps to see whether they hit again. A step where no row drafts is a plain one,
        which keeps mlx-lm's one-step-ahead overlap: drafts that miss cost little then."""
        most = self.config.num_speculative_tokens
        n = round(most * self._kept.get(uid, 1.0))
        if n == 0 and self._rested.get(uid, 0) >= PROBE_EVERY - 1:
            n = 1
        return min(n, budget)

    def _propose(self, uid: int, history: Sequence[int], pending: int, limit: int
                 ) -> list[int]:
        index = self._indices.get(uid)
        if index is None:
            index = self._indices[uid] = NgramIndex(self.config)
        index.extend(history[len(index):])
        index.extend([pending])
        return index.draft(limit)

    def saw(self, uids: Sequence[int], hidden: mx.array, following: mx.array,
            counts: Sequence[int]) -> None:
        """A target pass's hidden states, for a drafter that `wants_hidden`."""

    def observe(self, uid: int, drafted: int, kept: int) -> None:
        """A pass kept `kept` of the row's `drafted` guesses (none drafted: a step it
        rested, or one without speculation)."""
        if drafted:
            self._kept[uid] = 0.5 * self._kept.get(uid, 1.0) + 0.5 * kept / drafted
            self._rested[uid] = 0
        else:
            self._rested[uid] = self._rested.get(uid, 0) + 1

    def keep(self, uids: Sequence[int]) -> None:
        """Forget the rows that left the batch."""
        live = set(uids)
        for uid in [u for u in self._kept if u not in live]:
            del self._kept[uid]
        for uid in [u for u in self._rested if u not in live]:
            del self._rested[uid]
        for uid in [u for u in self._indices if u not in live]:
            del self._indices[uid]
