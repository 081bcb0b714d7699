"""Speculative decoding on a sharded replica: rank 0 decides, every rank verifies alike.

A verifying pass is one forward over each row's pending token and drafts, and on a sharded
replica every rank runs that forward together, so every rank needs the same drafts. Only
rank 0 has what drafts come from (the requests' grammars, and n-gram indices it keeps),
and only rank 0 runs the requests' own processors over the pass's logits, so only rank 0
knows how many drafts each row keeps. Two small collectives per speculative step carry its
decisions, as `replicas.engine.sharded.lockstep.LockstepSampler` carries its sampled tokens:

- `drafts`: before the pass, each row's drafts (a fixed-width table: a length, then the
  tokens), which the other ranks receive as zeros summed with rank 0's;
- `verdicts`: after it, each row's drafts kept and its next token, which every rank uses
  to roll back its own cache.

Both run on the batch's own stream, in the same order on every rank, like every other
collective of the batch.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class SharedDrafts:
    """One rank's side: rank 0 `leads` (its tables are summed with zeros)."""

    def __init__(self, group: mx.distributed.Group, stream: mx.Stream, leads: bool,
                 most: int) -> None:
        self._group = group
        self._stream = stream
        self.leads = leads
        self._most = most  # num_speculative_tokens: the table's width after the length

    def _sum(self, table: np.ndarray) -> np.ndarray:
        if not self.leads:
            table = np.zeros_like(table)
        out = mx.distributed.all_sum(mx.array(table), group=self._group, stream=self._stream)
        mx.eval(out)
        return np.array(out)

    def drafts(self, mine: list[list[int]], rows: int) -> list[list[int]]:
        """Rank 0's drafts for the batch's `rows` rows (`mine` is read on rank 0 only)."""
        table = np.zeros((rows, 1 + self._most), dtype=np.int32)
        if self.leads:
            for i, draft in enumerate(mine):
                table[i, 0] = len(draft)
                table[i, 1:1 + len(draft)] = draft
        got = self._sum(table)
        return [[int(t) for t in got[i, 1:1 + int(got[i, 0])]] for i in range(rows)]

    def verdicts(self, kept: list[int], nexts: list[int]) -> tuple[list[int], list[int]]:
        """Rank 0's drafts kept and next token per row."""
        got = self._sum(np.array([kept, nexts], dtype=np.int32))
        return [int(n) for n in got[0]], [int(t) for t in got[1]]
