"""Key spaces in the prefix cache: KV computed under a LoRA adapter is that adapter's alone.

A row with an adapter keys its prompt with the first token replaced by a negative id made
of the adapter's namespace (`replicas.engine.model.adapters`) and that token. The key keeps
its length, so everything that counts positions by key (hits, the disk tier, the prefix
directory's blocks, pulls between replicas) works unchanged, and no prefix is shared across
adapters or with the base model: the first position already differs.
"""

from __future__ import annotations

from typing import Sequence

_FLOOR = -(1 << 62)  # below every token id and every image content id (`replicas.vision`)
_TOKEN_BITS = 21  # vocabularies up to two million ids


def namespaced(tokens: Sequence[int], namespace: int) -> list[int]:
    """`tokens` as the prefix cache keys them in `namespace` (0: the base model's)."""
    if namespace == 0 or not tokens:
        return list(tokens)
    first = tokens[0] & ((1 << _TOKEN_BITS) - 1)
    return [_FLOOR - ((namespace << _TOKEN_BITS) | first), *tokens[1:]]
