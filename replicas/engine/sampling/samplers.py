"""Per-request samplers and the guard over a request's own logits processors.

The batch samples all its rows in one call only when every row holds the *same* sampler
object, so unseeded samplers are cached by their parameters and shared. Bias and penalties
are not processors here: `replicas.engine.sampling.penalties` applies them to the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, List, Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    greedy_sampler,
)

from replicas.contract import SamplingParams
from replicas.errors import InvalidRequestError
from replicas.engine.sampling.logprobs import MAX_TOP_LOGPROBS

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Reject values the samplers cannot honour, before the request reaches the engine."""
    if params.temperature < 0:
        raise InvalidRequestError("temperature must be >= 0", param="temperature")
    if not 0 < params.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    if params.top_k < 0:
        raise InvalidRequestError("top_k must be >= 0", param="top_k")
    if not 0 <= params.min_p <= 1:
        raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
    if params.repetition_penalty <= 0:
        raise InvalidRequestError("repetition_penalty must be > 0", param="repetition_penalty")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}",
                                  param="top_logprobs")
    for token_id in params.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )


def make_request_sampler(params: SamplingParams, sampled_before: int = 0) -> Sampler:
    """`sampled_before`: tokens a resumed request sampled elsewhere; a seeded sampler skips
    the keys they took, so it draws what the uninterrupted run would have."""
    if params.temperature == 0:
        return greedy_sampler
    if params.seed is None:
        return _shared_sampler(SamplingShape.of(params))
    return SeededSampler(params, sampled_before)


@dataclass(frozen=True)
class SamplingShape:
    """What a sampled row draws from, as mlx-lm's `make_sampler` builds it: the filters over
    the logprobs (top-p, min-p, top-k, in its order), then the temperature."""

    temperature: float
    top_p: float
    min_p: float
    top_k: int

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingShape:
        return cls(params.temperature, params.top_p, params.min_p, params.top_k)

    def filtered(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def scaled(self, logprobs: mx.array) -> mx.array:
        """The logits `mx.random.categorical` draws the row's token from."""
        return self.filtered(logprobs) * (1.0 / self.temperature)

    def logprobs(self, logprobs: mx.array) -> mx.array:
        """The log of the distribution the row draws from (a draft's q, the target's p), in
        float32: in bfloat16 a q/p ratio would be off by a few percent."""
        scaled = self.scaled(logprobs.astype(mx.float32))
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


class SharedSampler:
    """An unseeded sampler, one object per shape, so rows alike sample in one call."""

    def __init__(self, shape: SamplingShape) -> None:
        self.shape = shape

    def __call__(self, logprobs: mx.array) -> mx.array:
        # mlx-lm's own (compiled) draw, as its `make_sampler` makes it.
        return categorical_sampling(self.shape.filtered(logprobs), self.shape.temperature)


@lru_cache(maxsize=256)
def _shared_sampler(shape: SamplingShape) -> SharedSampler:
    return SharedSampler(shape)


class SeededSampler:
    """A sampler with its own PRNG key, so a seed reproduces whatever else is in the batch."""

    def __init__(self, params: SamplingParams, skip: int = 0) -> None:
        self._key = mx.random.key(params.seed or 0)
        self.advance(skip)  # the same split per token as `__call__`
        self._shape = SamplingShape.of(params)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, step_key = mx.random.split(self._key)
        return self._draw(logprobs, step_key)

    def ahead(self, logprobs: mx.array, skip: int = 0) -> mx.array:
        """Row j of `logprobs` (one sequence's next positions) drawn with the key the
        (skip + j)-th next call would use, none spent: speculation then `advance`s by the
        tokens it kept, so a seeded sequence is the same with and without it."""
        key, drawn = self._key, []
        for _ in range(skip):
            key, _ = mx.random.split(key)
        for j in range(logprobs.shape[0]):
            key, step_key = mx.random.split(key)
            drawn.append(self._draw(logprobs[j:j + 1], step_key))
        return mx.concatenate(drawn)

    def advance(self, n: int) -> None:
        for _ in range(n):
            self._key, _ = mx.random.split(self._key)

    def _draw(self, logprobs: mx.array, key: mx.array) -> mx.array:
        return mx.random.categorical(self._shape.scaled(logprobs), key=key)


@runtime_checkable
class Drafting(Protocol):
    """A request's processor that knows tokens that must come next (the pipeline's
    controller: a grammar's forced tokens, a forced end of reasoning)."""

    def draft(self, pending: int, limit: int) -> list[int]: ...


class GuardedProcessors:
    """One request's logits processors, isolated from the rest of the batch.

    mlx-lm runs every request's processors inside one batch step, so one that raised would
    fail the whole batch. This records the error and passes the logits through; the engine
    then ends just this request.
    """

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self._processors = processors
        self.error: str | None = None

    def draft(self, pending: int, limit: int) -> list[int]:
        """The first draft a processor of the request offers (`Drafting`), none if it
        fails: a draft is only a guess, so a failure costs nothing but the guess."""
        if self.error is not None:
            return []
        for processor in self._processors:
            if isinstance(processor, Drafting):
                try:
                    if drafted := processor.draft(pending, limit):
                        return drafted[:limit]
                except Exception:  # noqa: BLE001 - no draft; the step reports real errors
                    return []
        return []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.error is not None:
            return logits
        try:
            out = logits
            for processor in self._processors:
                out = processor(tokens, out)
            if out.shape != logits.shape:
                raise ValueError(f"a logits processor returned shape {out.shape}")
            return out
        except Exception as exc:  # noqa: BLE001 - reported through `error`
            self.error = f"{type(exc).__name__}: {exc}"
            return logits


def guarded_processors(processors: List[LogitsProcessor]) -> GuardedProcessors | None:
    """A request's own processors (the pipeline's: grammar mask, budgets, bans), guarded;
    None when there are none, and the row stays on the batched path."""
    return GuardedProcessors(processors) if processors else None
