"""The speculation gate inside the engine's batch (`replicas.engine.spec.gate`): where
drafting steps are timed slower than plain ones for the tokens they make, the batch stops
drafting and decodes plain steps, with the same greedy output; where they pay, it keeps
drafting. The gate runs on a clock of its own here (steps cost what the test says), so
what is checked is the batch's obedience, not this machine's speed."""

from __future__ import annotations

from dataclasses import replace

from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Row
from replicas.engine.config import EngineConfig
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.engine.spec.gate import WINDOW, SpeculationGate
from tests.integration.test_speculative import GREEDY, SPEC, model, prompts

GATED = replace(SPEC, disable_when_slower=True)
TOKENS = 8 * WINDOW  # steps enough for a window of each mode and more (drafts hit)


class Timed(SpeculationGate):
    """A drafting step costs `drafting_cost` plain steps, on this gate's own clock."""

    def __init__(self, drafting_cost: float) -> None:
        self.now, self.cost = 0.0, drafting_cost
        self.modes: list[tuple[int, bool]] = []  # each step's rows and whether it may draft
        self.verified: list[int] = []  # the draft tokens the batch had verified before each
        self.batch: LocalBatch | None = None
        super().__init__(clock=lambda: self.now)

    def allow(self, rows: int) -> bool:
        drafting = super().allow(rows)
        self.modes.append((rows, drafting))
        assert self.batch is not None
        self.verified.append(self.batch.decode_stats.drafted)
        self.now += self.cost if drafting else 1.0
        return drafting


def run(spec: object, gate: SpeculationGate | None) -> tuple[list[list[int]], LocalBatch]:
    rows = [p for p in prompts() if len(p) >= 24][:3]  # spans that repeat: drafts hit
    batch = LocalBatch(model("builtin:tiny"), EngineConfig(speculative=spec,  # type: ignore[arg-type]
                                                           prompt_cache_bytes=0), gate=gate)
    if isinstance(gate, Timed):
        gate.batch = batch
    uids = [uid for uid, _ in batch.insert([
        Row(tuple(p), 0, TOKENS, frozenset(), make_request_sampler(GREEDY), ()) for p in rows])]
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while not batch.empty:
        for response in batch.step():
            out[response.uid].append(response.token)
    return [out[u] for u in uids], batch


def obeyed(drafting_cost: float) -> tuple[Timed, LocalBatch, list[bool], list[int]]:
    """A gated run against the plain one: the same greedy output, and no step the gate
    held back verified a draft. Returns the gate, the batch, whether each step of all 3
    rows could draft, and the drafts each step verified."""
    plain, _ = run(None, None)
    gate = Timed(drafting_cost)
    got, batch = run(GATED, gate)
    assert got == plain
    verified = [b - a for a, b in zip(gate.verified, gate.verified[1:])]
    assert not any(v for v, (_, drafting) in zip(verified, gate.modes) if not drafting)
    full = [drafting for rows, drafting in gate.modes if rows == 3]
    assert len(full) > 2 * WINDOW
    return gate, batch, full, verified


def test_drafting_timed_slower_stops_and_the_output_stays() -> None:
    gate, _, full, verified = obeyed(drafting_cost=50.0)  # no run of kept drafts pays that
    assert gate.drafting(3) is False
    # Drafting measured first, then plain steps (the next probe is 16 windows away).
    assert full == [True] * WINDOW + [False] * (len(full) - WINDOW)
    assert sum(verified[:WINDOW]) > 0


def test_drafting_that_pays_is_kept_in_the_batch() -> None:
    gate, batch, full, verified = obeyed(drafting_cost=1.0)  # as cheap as a plain step
    assert gate.drafting(3) is True
    # Each mode measured once, then drafting for good (the probe is 16 windows away).
    assert full == [True] * WINDOW + [False] * WINDOW + [True] * (len(full) - 2 * WINDOW)
    assert sum(verified[2 * WINDOW:]) > 0  # drafting again after the plain window
    counts = batch.decode_counts()
    assert counts.accepted > 0 and counts.passes < counts.tokens


def test_off_in_the_config_drafts_at_every_size() -> None:
    _, batch = run(SPEC, None)
    assert batch.gate is None
    _, gated = run(GATED, None)
    assert isinstance(gated.gate, SpeculationGate)
