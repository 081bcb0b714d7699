"""Per-request grammar state: consume sampled answer tokens, mask the next logits."""

from __future__ import annotations

import functools
from typing import cast

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher

from replicas.errors import InvalidRequestError
from replicas.pipeline.guided.bitmask import apply_token_bitmask
from replicas.pipeline.guided.compiler import PARSER_LIMITS
from replicas.pipeline.guided.tokenizer import GuidedTokenizer


class GuidedMatcher:
    """One request's position in its grammar.

    Call `mask()` before sampling each answer token and `consume()` with every sampled
    answer token, end-of-sequence ids included; the first `mask()` comes before any
    `consume()`. llguidance never raises on a bad token: the matcher enters a sticky error
    state instead, so check `error` after each `consume()` and end that request if set.
    """

    def __init__(self, tokenizer: GuidedTokenizer, grammar: str) -> None:
        self._vocab_size = tokenizer.vocab_size
        self._matcher = _pristine(tokenizer, grammar).deep_copy()
        if self._matcher.is_error():
            # Only tokenizer-dependent limits can get here after compile_guided: still
            # before generation, so it is the client's 400.
            raise InvalidRequestError(f"guided grammar rejected: {self._matcher.get_error()}")

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token (a disallowed one puts the matcher in error)."""
        self._matcher.consume_token(token_id)

    def mask(self, logits: mx.array) -> mx.array:
        """`logits` (1, V) with every token the grammar forbids next set to -inf.

        Once the grammar is complete only the end-of-sequence ids remain; in the error
        state too, so a step already in flight can only end the sequence.
        """
        if logits.shape[-1] != self._vocab_size:
            raise ValueError(
                f"logits width {logits.shape[-1]} != guided vocab size {self._vocab_size}"
            )
        # Start the forward pass that produces `logits`, so the model runs while the CPU
        # computes the mask (compute_bitmask releases the GIL).
        mx.async_eval(logits)
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)
        return apply_token_bitmask(logits, mx.array(words).reshape(1, -1))

    def forced_after(self, token_id: int, limit: int) -> list[int]:
        """The tokens the grammar forces once `token_id` is consumed (JSON keys and
        punctuation, a call's fixed markup), at most `limit`, the state left as it was:
        drafts for speculation, which the target then verifies under this grammar's mask."""
        m = self._matcher
        if limit <= 0 or m.is_error() or m.try_consume_tokens([token_id]) != 1:
            return []
        try:
            return list(m.compute_ff_tokens())[:limit]
        finally:
            m.rollback(1)

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and admits no more text: the request ends now."""
        m = self._matcher
        return m.is_stopped() and m.is_accepting() and not m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token the grammar forbids, a parser limit), if it did."""
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "guided matcher failed"


@functools.lru_cache(maxsize=64)
def _pristine(tokenizer: GuidedTokenizer, grammar: str) -> LLMatcher:
    """A matcher that never consumes, copied per request. Building one takes milliseconds
    (tens for many tools); a copy takes microseconds, and agents resend the same tools and
    schemas on every turn."""
    return LLMatcher(tokenizer.ll, grammar, log_level=0, limits=PARSER_LIMITS)


class GuidedLogitsProcessor:
    """An mlx-lm logits processor (`(tokens, logits) -> logits`) driving a GuidedMatcher.

    For requests whose whole output is constrained (no reasoning channel). mlx-lm calls
    it once per decode step with the full token history, prompt included; the first call
    sees only the prompt, later calls consume whatever was appended since the last one.
    """

    def __init__(self, matcher: GuidedMatcher) -> None:
        self.matcher = matcher
        self._seen: int | None = None  # history length already accounted for

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.async_eval(logits)  # queue the forward pass before blocking on the history
        if self._seen is not None:
            for token in cast(list[int], tokens[self._seen :].tolist()):
                self.matcher.consume(token)
        self._seen = tokens.size
        return self.matcher.mask(logits)
