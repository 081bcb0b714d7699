"""The figures every benchmark reports: a run's count over its seconds, a median with its
range, percentiles and a bootstrap interval for a median ratio."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Run:
    """One timed run: `count` units (tokens, embeddings, requests) in `seconds`, with each
    request's time to first token where the run has them."""

    count: int
    seconds: float
    ttft: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0


class Spread(NamedTuple):
    """A median with its min-max: on a shared machine one run is noise, the range says how much."""

    median: float
    min: float
    max: float

    def text(self, fmt: str = ".1f", scale: float = 1.0) -> str:
        """`median (min-max)`, each value times `scale` in the format `fmt`."""
        return (f"{format(self.median * scale, fmt)} ({format(self.min * scale, fmt)}-"
                f"{format(self.max * scale, fmt)})")


def spread(values: Iterable[float]) -> Spread:
    values = list(values)
    return Spread(statistics.median(values), min(values), max(values))


def at_least_three(count: int, flag: str) -> None:
    """A headline figure is a median of at least 3 runs: refuse fewer before anything runs."""
    if count < 3:
        raise SystemExit(f"{flag} must be at least 3: a median of fewer is one run")


def median_run(runs: list[Run]) -> Run:
    """The run with the median rate: one request is noisy on a shared machine."""
    return sorted(runs, key=lambda r: r.rate)[len(runs) // 2]


def median_interval(values: list[float], confidence: float = 0.9,
                    resamples: int = 4000) -> tuple[float, float]:
    """A bootstrap interval for the median: on a noisy machine, whether a ratio clears a
    target is a question about this interval, not about one run."""
    rng = random.Random(0)  # the same pairs always give the same interval
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def nearest_rank(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN when there are no values): `vs_mlx_server`'s tables."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def pct(values: list[float], q: float) -> float:
    """The value at rank `int(q * n)` (0 when there are none): one above nearest-rank's at
    some sizes, kept for the figures `overhead` and `resume` recorded with it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
