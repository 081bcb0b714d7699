"""Drafts for speculative decoding by prompt lookup (n-gram matching, vLLM's `ngram`).

A coding agent re-emits large spans of what it read: the file it edits, the diff it
quotes, the JSON it echoes. When the newest few tokens of a sequence occurred before in
it, the tokens that followed them then are a good guess for what follows now, at no cost
but a dictionary lookup. The target model checks the guess in the next pass
(`replicas.engine.spec.drafter`).
"""

from __future__ import annotations

from typing import Sequence

from replicas.engine.config import SpeculativeConfig


class NgramIndex:
    """One sequence's tokens, and where each of its n-grams last ended, grown as it grows.

    An index rather than a scan: a scan of an agent's 30k-token history per row per step
    would cost more than the pass it saves. Each new token costs one dictionary write per
    n-gram length.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self._config = config
        self._tokens: list[int] = []
        # n-gram -> the position of its last token, for n-grams ending before the newest.
        self._ends: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens`; every n-gram ending before the new newest token gets indexed."""
        low, high = self._config.prompt_lookup_min, self._config.prompt_lookup_max
        seq = self._tokens
        for token in tokens:
            end = len(seq) - 1  # the current newest becomes an earlier position
            if end >= 0:
                for n in range(low, min(high, end + 1) + 1):
                    self._ends[tuple(seq[end - n + 1:end + 1])] = end
            seq.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest recurring suffix, newest match.
        A match that ends close behind the newest token is a loop (a repeated token, a
        repeated line): its continuation runs into the present, and goes on around the
        loop, as the sequence would if it kept repeating."""
        seq = self._tokens
        if limit <= 0 or not seq:
            return []
        low, high = self._config.prompt_lookup_min, self._config.prompt_lookup_max
        for n in range(min(high, len(seq)), low - 1, -1):
            end = self._ends.get(tuple(seq[-n:]))
            if end is not None:
                after = seq[end + 1:]  # never empty: the match ends before the newest
                return [after[i % len(after)] for i in range(limit)]
        return []
