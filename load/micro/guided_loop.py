"""The decode loop the guided-decoding benchmarks share (`guided`, `tools`): mlx-lm's
`BatchGenerator` with or without a grammar per request, and the mask's cost per token."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchGenerator

from replicas.pipeline.guided import GuidedLogitsProcessor, GuidedMatcher, GuidedTokenizer


@dataclass(frozen=True)
class Decode:
    tokens_per_s: float
    tokens: int
    outputs: list[list[int]]


def mask_us(tok: GuidedTokenizer, tokens: list[int], grammar: str) -> tuple[float, float]:
    """Replay a constrained output: time each mask() to an evaluated result."""
    matcher = GuidedMatcher(tok, grammar)
    logits = mx.random.normal((1, tok.vocab_size))
    mx.eval(logits)
    times = []
    for token in tokens:
        start = time.perf_counter()
        mx.eval(matcher.mask(logits))
        times.append(time.perf_counter() - start)
        matcher.consume(token)
        if matcher.error is not None:  # a replay the grammar refuses times nothing real
            raise RuntimeError(f"the replayed text leaves the grammar: {matcher.error}")
    return 1e6 * float(np.mean(times)), 1e6 * float(np.percentile(times, 99))


def decode(model: nn.Module, tok: GuidedTokenizer, prompt: list[int], batch: int,
           max_tokens: int, guided: bool, grammar: Callable[[], str] | None = None) -> Decode:
    """Greedy decode of `batch` copies of the prompt; tokens/s over the decode steps.
    Guided runs use `grammar()` per request."""
    if guided and grammar is None:
        raise ValueError("a guided decode needs its grammar")
    gen = BatchGenerator(model, max_tokens=max_tokens,
                         stop_tokens=[[t] for t in tok.eos_token_ids])
    processors: list[list[Callable[[mx.array, mx.array], mx.array]]] = [
        [GuidedLogitsProcessor(GuidedMatcher(tok, grammar()))] if guided and grammar else []
        for _ in range(batch)
    ]
    uids = gen.insert([prompt] * batch, logits_processors=processors)
    outputs: dict[int, list[int]] = {uid: [] for uid in uids}
    done = 0
    with gen.stats() as stats:
        while done < batch:
            for response in gen.next()[1]:
                outputs[response.uid].append(response.token)
                done += response.finish_reason is not None
    gen.close()
    return Decode(stats.decode_tps, stats.generation_tokens, [outputs[u] for u in uids])
