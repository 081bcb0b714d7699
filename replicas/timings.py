"""Engine timings for metrics: each decode step's duration and batch size (the engine's
step callback), each grammar compile, a sharded replica's sync per step, and each
embeddings request's inputs and tokens, and each prompt's images through a vision tower.
Recorded as
plain samples on bounded deques (an append per step, no metric call on the engine thread);
the deployment drains them on its metrics poll."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

# Samples kept between polls; older ones are dropped when nobody drains (metrics off).
_KEEP = 4096


@dataclass(frozen=True)
class TimingSamples:
    steps: tuple[tuple[float, int], ...]  # (seconds, sequences that got a token) per step
    grammar_compile_s: tuple[float, ...]
    # A sharded replica's wait at each step boundary: its batch record queues behind the
    # step mlx-lm still evaluates asynchronously (its collectives included), then crosses.
    sync_s: tuple[float, ...] = ()
    embeddings: tuple[tuple[int, int], ...] = ()  # (inputs, tokens) per embeddings request
    images: tuple[tuple[int, float], ...] = ()  # (images, seconds encoding them) per prompt


class Timings:
    def __init__(self) -> None:
        self._steps: deque[tuple[float, int]] = deque(maxlen=_KEEP)
        self._grammar: deque[float] = deque(maxlen=_KEEP)
        self._sync: deque[float] = deque(maxlen=_KEEP)
        self._embeddings: deque[tuple[int, int]] = deque(maxlen=_KEEP)
        self._images: deque[tuple[int, float]] = deque(maxlen=_KEEP)
        # Running totals of the sync, read by benchmarks without draining the samples.
        self.sync_steps = 0
        self.sync_seconds = 0.0

    def step(self, seconds: float, batch: int) -> None:
        self._steps.append((seconds, batch))

    def sync(self, seconds: float) -> None:
        self._sync.append(seconds)
        self.sync_steps += 1
        self.sync_seconds += seconds

    def grammar_compiled(self, seconds: float) -> None:
        self._grammar.append(seconds)

    def embedded(self, inputs: int, tokens: int) -> None:
        self._embeddings.append((inputs, tokens))

    def encoded(self, images: int, seconds: float) -> None:
        self._images.append((images, seconds))

    def drain(self) -> TimingSamples:
        # popleft is atomic: the engine thread may append meanwhile and nothing is lost.
        return TimingSamples(_drain(self._steps), _drain(self._grammar), _drain(self._sync),
                             _drain(self._embeddings), _drain(self._images))


def _drain(samples: deque[Any]) -> tuple[Any, ...]:
    out = []
    while True:
        try:
            out.append(samples.popleft())
        except IndexError:
            return tuple(out)
