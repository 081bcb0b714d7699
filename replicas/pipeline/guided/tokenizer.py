"""The model's vocabulary as llguidance sees it: built once per model, shared by requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf


@dataclass(frozen=True)
class GuidedTokenizer:
    """An `LLTokenizer` sized to the model's logits, with every end-of-sequence id.

    `vocab_size` is the logits width, which may exceed the tokenizer (embedding tables are
    padded to a round size): llguidance treats the extra ids as empty tokens, so they are
    never allowed. Every id in `eos_token_ids` is allowed once the grammar is satisfied.
    """

    ll: llguidance.LLTokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(
        cls, hf_tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GuidedTokenizer:
        """Wrap a fast Hugging Face tokenizer (for mlx-lm: `TokenizerWrapper._tokenizer`)."""
        eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        if not eos:
            raise ValueError("guided decoding needs at least one end-of-sequence token id")
        if any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"end-of-sequence ids {eos} must lie in [0, {vocab_size})")
        if len(hf_tokenizer) > vocab_size:
            raise ValueError(
                f"logits width {vocab_size} is smaller than the tokenizer's "
                f"{len(hf_tokenizer)} tokens"
            )
        ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos))
        return cls(ll=ll, vocab_size=vocab_size, eos_token_ids=eos)
