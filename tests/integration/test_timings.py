"""The replica's timing samples for metrics (replicas.timings): every engine step's time and
batch size, and each grammar compile, drained once."""

from __future__ import annotations

import asyncio
import dataclasses

from replicas.contract import Finished, GuidedSpec
from replicas.replica import ModelReplica
from tests.integration.test_replica import request_for
from tests.streams import collect


def test_steps_and_grammar_compiles_are_sampled_and_drained(replica: ModelReplica) -> None:
    replica.drain_timings()  # whatever earlier tests left
    plain = request_for("riddle-think", rid="timing-plain")
    guided = dataclasses.replace(request_for("riddle-think", rid="timing-guided"),
                                 guided=GuidedSpec("json_object"))

    async def both() -> None:
        for request in (plain, guided):
            events = await collect(replica.stream(request))
            assert isinstance(events[-1], Finished)

    asyncio.run(both())
    samples = replica.drain_timings()
    assert len(samples.steps) >= 10  # one per decode step, both requests
    assert all(seconds > 0 and batch >= 0 for seconds, batch in samples.steps)
    assert any(batch == 1 for _, batch in samples.steps)
    assert len(samples.grammar_compile_s) == 1 and samples.grammar_compile_s[0] > 0
    again = replica.drain_timings()
    assert again.steps == () and again.grammar_compile_s == ()
