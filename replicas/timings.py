"""Engine timings for metrics: each decode step's duration and batch size, and each grammar
compile. Recorded as plain samples on a bounded deque (an append per step, no metric call on
the engine thread); the deployment drains them on its metrics poll."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.generate import BatchGenerator

from replicas.engine import Engine, EngineConfig
from replicas.loading import LoadedModel

# Samples kept between polls; older ones are dropped when nobody drains (metrics off).
_KEEP = 4096


@dataclass(frozen=True)
class TimingSamples:
    steps: tuple[tuple[float, int], ...]  # (seconds, sequences that got a token) per step
    grammar_compile_s: tuple[float, ...]


class Timings:
    def __init__(self) -> None:
        self._steps: deque[tuple[float, int]] = deque(maxlen=_KEEP)
        self._grammar: deque[float] = deque(maxlen=_KEEP)

    def step(self, seconds: float, batch: int) -> None:
        self._steps.append((seconds, batch))

    def grammar_compiled(self, seconds: float) -> None:
        self._grammar.append(seconds)

    def drain(self) -> TimingSamples:
        # popleft is atomic: the engine thread may append meanwhile and nothing is lost.
        return TimingSamples(_drain(self._steps), _drain(self._grammar))


def _drain(samples: deque[Any]) -> tuple[Any, ...]:
    out = []
    while True:
        try:
            out.append(samples.popleft())
        except IndexError:
            return tuple(out)


class TimedEngine(Engine):
    """The engine, with each `BatchGenerator.next()` timed into `timings`."""

    def __init__(self, loader: Callable[[], LoadedModel], config: EngineConfig,
                 timings: Timings) -> None:
        super().__init__(loader, config)
        self._timings = timings

    def _new_generator(self) -> BatchGenerator:
        generator = super()._new_generator()
        step = generator.next
        record = self._timings.step

        def timed_next() -> Any:
            started = time.perf_counter()
            result = step()
            record(time.perf_counter() - started, len(result[1]))
            return result

        setattr(generator, "next", timed_next)  # an instance attribute: this generator only
        return generator
