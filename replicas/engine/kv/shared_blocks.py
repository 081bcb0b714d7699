"""Blocks that several reservations share, counted once (paged admission, issue 58).

On a paged batch a prefix cache hit joins by sharing the cached entry's blocks, so N rows on
one long history hold it once. Admission (`replicas.engine.kv.budget.KvBudget`) counts each
row's own blocks and, through `SharedBlocks`, every shared block once however many rows
hold it. What a row shares comes from the batch (`Shares`: `batch/paging.py`): the full
blocks of its hit, by one layer's ids (every layer's tables alike in count); the partial
last block is the row's own, since it copies that block before its first write.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Protocol, Sequence

NO_BLOCKS: frozenset[int] = frozenset()


class Shares(Protocol):
    """What a paged batch tells admission of the prefix cache's blocks its rows share."""

    def would_share(self, tokens: Sequence[int], adapter: str | None) -> frozenset[int]:
        """The blocks a row of this prompt would share if it joined now."""
        ...

    def shared_by(self, uid: int) -> frozenset[int] | None:
        """The blocks row `uid` of the batch shares (None: not in the batch)."""
        ...


class SharedBlocks:
    """Each reservation's shared blocks, and how many reservations hold each block."""

    def __init__(self) -> None:
        self.by_key: dict[Hashable, frozenset[int]] = {}
        self._holders: Counter[int] = Counter()
        self._total = 0  # the sum of `by_key`'s sizes

    def __len__(self) -> int:
        """Distinct shared blocks: what they hold."""
        return len(self._holders)

    def of(self, key: Hashable) -> frozenset[int]:
        return self.by_key.get(key, NO_BLOCKS)

    def twice(self, key: Hashable, blocks: frozenset[int]) -> int:
        """Were `key` to share `blocks`: how many of the reservations' blocks another
        reservation counts too (summed sizes less distinct blocks), to take off their sum."""
        old = self.of(key)
        if blocks is old:
            return self._total - len(self._holders)
        union = len(self._holders) + sum(1 for b in blocks if b not in self._holders) \
            - sum(1 for b in old if self._holders[b] == 1 and b not in blocks)
        return self._total - len(old) + len(blocks) - union

    def set(self, key: Hashable, blocks: frozenset[int]) -> None:
        old = self.of(key)
        if blocks is old:
            return
        self.drop(key)
        if blocks:
            self.by_key[key] = blocks
            self._holders.update(blocks)
            self._total += len(blocks)

    def drop(self, key: Hashable) -> None:
        old = self.by_key.pop(key, NO_BLOCKS)
        self._total -= len(old)
        for b in old:
            self._holders[b] -= 1
            if self._holders[b] <= 0:
                del self._holders[b]
