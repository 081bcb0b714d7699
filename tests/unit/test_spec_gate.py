"""The speculation gate: drafting kept at a batch size only while it makes more tokens a
second than plain steps, by windows it times (`replicas.engine.spec.gate`)."""

from __future__ import annotations

from replicas.engine.spec.gate import PROBE_EVERY, WINDOW, SpeculationGate, size_class


class Machine:
    """A fake clock and batch: a step costs `cost[mode]` seconds and emits
    `tokens[mode]` tokens, mode being what the gate allowed."""

    def __init__(self, cost: dict[bool, float], tokens: dict[bool, int]) -> None:
        self.now = 0.0
        self.cost, self.tokens = cost, tokens
        self.gate = SpeculationGate(clock=lambda: self.now)

    def step(self, rows: int, found: bool = True) -> bool:
        """One step; `found`: whether the rows had drafts, where drafting was allowed."""
        drafting = self.gate.allow(rows) and found
        self.now += self.cost[drafting]
        self.gate.emitted(self.tokens[drafting], drafted=drafting)
        return drafting

    def run(self, steps: int, rows: int = 32) -> list[bool]:
        return [self.step(rows) for _ in range(steps)]


def test_drafting_that_is_slower_stops_but_for_a_probe_window_now_and_then() -> None:
    # 32 rows: a drafting step costs 4x a plain one for 1.5x its tokens.
    m = Machine(cost={True: 4.0, False: 1.0}, tokens={True: 48, False: 32})
    first = m.run(2 * WINDOW)
    assert first == [True] * WINDOW + [False] * WINDOW  # each mode measured once
    later = m.run(PROBE_EVERY * WINDOW)
    assert m.gate.drafting(32) is False
    # One window in PROBE_EVERY drafts again, to see whether it pays now.
    assert sum(later) == WINDOW
    assert later[:(PROBE_EVERY - 1) * WINDOW] == [False] * ((PROBE_EVERY - 1) * WINDOW)


def test_drafting_that_pays_is_kept() -> None:
    # One row whose drafts mostly hit: 2.3x the cost for 4.5x the tokens.
    m = Machine(cost={True: 2.3, False: 1.0}, tokens={True: 9, False: 2})
    m.run(2 * WINDOW, rows=1)
    assert sum(m.run(PROBE_EVERY * WINDOW, rows=1)) == (PROBE_EVERY - 1) * WINDOW
    assert m.gate.drafting(1) is True


def test_a_probe_sees_a_workload_that_changed() -> None:
    m = Machine(cost={True: 4.0, False: 1.0}, tokens={True: 40, False: 32})
    m.run(2 * WINDOW + 1)
    assert m.gate.drafting(32) is False
    m.tokens[True] = 32 * 5  # the rows' drafts start to hit: 5 tokens a row per pass
    m.run(2 * PROBE_EVERY * WINDOW - 1)  # two probes: the average moves half-way a window
    assert m.run(WINDOW) == [True] * WINDOW
    assert m.gate.drafting(32) is True


def test_each_batch_size_class_is_measured_on_its_own() -> None:
    assert size_class(27) == size_class(32) == size_class(38)
    assert len({size_class(n) for n in (1, 2, 4, 8, 16, 32)}) == 6
    m = Machine(cost={True: 4.0, False: 1.0}, tokens={True: 48, False: 32})
    m.run(2 * WINDOW + 1, rows=32)
    assert m.gate.drafting(32) is False
    assert m.gate.drafting(1) is None
    assert m.step(rows=1) is True  # a new size starts by measuring drafting


def test_the_wait_for_requests_is_no_window() -> None:
    m = Machine(cost={True: 1.0, False: 1.0}, tokens={True: 64, False: 32})
    m.run(WINDOW - 1)
    m.gate.pause()  # the batch emptied: what it ran is measured, up to now
    m.now += 1000.0  # an idle hour would make drafting look slow
    assert m.run(WINDOW) == [False] * WINDOW  # drafting was measured before the pause
    m.gate.pause()
    m.now += 1000.0
    assert m.gate.drafting(32) is True
    assert m.step(32) is True


def test_a_window_cut_short_by_a_size_change() -> None:
    m = Machine(cost={True: 4.0, False: 1.0}, tokens={True: 48, False: 32})
    m.run(WINDOW // 2 - 1, rows=32)  # too short to say anything
    m.run(1, rows=8)
    assert m.gate.drafting(32) is None
    m.run(WINDOW // 2, rows=32)  # half a window: recorded when the size changes
    m.step(rows=8)
    m.run(WINDOW, rows=32)
    m.step(rows=8)
    assert m.gate.drafting(32) is False


def test_windows_where_no_row_had_drafts_say_nothing_of_drafting() -> None:
    # A reply's first tokens repeat nothing yet: drafting allowed, nothing drafted. Such
    # steps are plain ones (a little slower, without the overlap), which must not stop
    # drafting before it was ever tried.
    m = Machine(cost={True: 2.3, False: 1.0}, tokens={True: 9, False: 2})
    for _ in range(3 * WINDOW):
        m.step(1, found=False)
    assert m.gate.drafting(1) is None
    assert m.run(WINDOW, rows=1) == [True] * WINDOW  # still allowed; now drafts are found
    assert m.run(WINDOW, rows=1) == [False] * WINDOW  # the plain steps measured
    m.step(1)
    assert m.gate.drafting(1) is True
