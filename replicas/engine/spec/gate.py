"""Whether speculating pays at the batch's size, measured on the machine that runs it.

A verifying pass computes every row at the width of the widest draft in it. Where a pass is
bound by reading the weights (a Mac at small batches, a GPU) the extra positions cost
little; where it is bound by compute (a CPU, a large batch anywhere) each costs about what
a token does. On the project's CPU box, 32 rows padded to 5 positions for the drafts of a
few rows made the batch 0.60x as fast as not drafting at all. The per-row rest
(`speculation.Drafter.limit`) stops rows whose drafts miss; this gate stops the batch when
drafting as a whole is slower than not, whatever the drafts' hit rate.

It runs windows of `WINDOW` steps with drafting on and off at each batch size, keeps the
one that made more tokens a second, and runs the other again one window in `PROBE_EVERY`,
so a change of workload (rows whose drafts start to hit) is seen. vLLM has only
`disable_by_batch_size`, a size the user must find; a position's cost differs by machine,
model and context length, so the engine measures it instead.

Windows that switch mode are biased toward the plain step by about one pass (the pipelined
plain step's queued pass falls on the other side of the boundary), so drafting has to win
by that much to be kept. Engine thread only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

WINDOW = 16  # steps one measurement spans
PROBE_EVERY = 16  # windows: one in this many runs the slower mode again


def size_class(rows: int) -> int:
    """Batch sizes measured together: two classes per doubling, so 27 to 38 rows (a batch
    of 32 give or take the rows ending and joining) share one."""
    return round(2 * math.log2(rows))


@dataclass
class _Rates:
    """Tokens per second, averaged over windows, with drafting on and off."""

    drafting: float | None = None
    plain: float | None = None
    windows: int = 0  # chosen since both were measured


@dataclass
class _Window:
    size: int
    drafting: bool
    start: float
    steps: int = 0
    tokens: int = 0
    verified: int = 0  # steps that verified drafts


class SpeculationGate:
    """Asked once a step whether the step may draft; told the tokens each step emitted."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._rates: dict[int, _Rates] = {}
        self._window: _Window | None = None

    def allow(self, rows: int) -> bool:
        """Whether this step of `rows` rows may draft. Call it before each step."""
        now = self._clock()
        size = size_class(rows)
        window = self._window
        if window is not None and (window.steps >= WINDOW or window.size != size):
            if window.steps >= WINDOW // 2:  # a size change ends it early; too short says little
                self._record(window, now)
            window = None
        if window is None:
            window = self._window = _Window(size, self._choose(size), now)
        window.steps += 1
        return window.drafting

    def emitted(self, tokens: int, drafted: bool) -> None:
        """Tokens the step just allowed emitted, over all its rows, and whether it
        verified drafts."""
        if self._window is not None:
            self._window.tokens += tokens
            self._window.verified += drafted

    def pause(self) -> None:
        """The batch emptied: the window ends here (the wait for the next request is no
        step's time)."""
        if self._window is not None and self._window.steps >= WINDOW // 2:
            self._record(self._window, self._clock())
        self._window = None

    def drafting(self, rows: int) -> bool | None:
        """Which mode is faster at `rows` rows, as measured so far (None: not yet both)."""
        rates = self._rates.get(size_class(rows))
        if rates is None or rates.drafting is None or rates.plain is None:
            return None
        return rates.drafting >= rates.plain

    def _choose(self, size: int) -> bool:
        rates = self._rates.setdefault(size, _Rates())
        if rates.drafting is None:
            return True  # the config asked for speculation: measure it first
        if rates.plain is None:
            return False
        rates.windows += 1
        faster = rates.drafting >= rates.plain
        return not faster if rates.windows % PROBE_EVERY == 0 else faster

    def _record(self, window: _Window, now: float) -> None:
        if window.drafting and not window.verified:
            # No row had drafts (a reply that repeats nothing yet): its steps were plain
            # ones, and say nothing of what drafting costs or saves.
            return
        rate = window.tokens / max(now - window.start, 1e-9)
        rates = self._rates[window.size]
        old = rates.drafting if window.drafting else rates.plain
        new = rate if old is None else (old + rate) / 2
        if window.drafting:
            rates.drafting = new
        else:
            rates.plain = new
