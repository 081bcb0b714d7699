"""Rows that join a decoding batch (`replicas.engine.batch.prefill`): their prompt's last token
rides in the batch's next pass instead of a pass of its own, on built-in models of several
architectures loaded through the production loader.

The path is observed, not timed: every model call is recorded by its (rows, positions), and
no step may run more than one single-position pass (mlx-lm's own join runs the joining
rows' pass beside the batch's, which the same check catches). Greedy output is mlx-lm's
`BatchGenerator` run on the same arrivals, token for token.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator

from replicas.contract import SamplingParams
from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Done, Row
from replicas.engine.config import EngineConfig
from replicas.engine.model.loading import load_model
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.sources import resolve_source

# Plain attention, gpt-oss's sliding window and MoE, MLA (DeepSeek V3), Qwen3-Next's linear
# attention, Nemotron-H's SSM: each keeps its cache its own way.
SOURCES = ["builtin:tiny", "builtin:arch-sliding", "builtin:arch-mla", "builtin:arch-linear",
           "builtin:arch-ssm"]
GREEDY = SamplingParams(temperature=0.0)
# Each prompt joins once the batch has made this many steps, and decodes this many tokens.
ARRIVALS = [(0, 24), (0, 9), (3, 20), (5, 16), (5, 12), (11, 18)]


@lru_cache(maxsize=None)
def model(source: str) -> nn.Module:
    return load_model(source, resolve_source(source)).model


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 500 + 3 for j in range(5 + 4 * i)]


class Recorded:
    """Each call of a model class's instances, by its (rows, positions)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
        self.calls: list[tuple[int, int]] = []
        call = cls.__call__

        def recorded(module: nn.Module, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((inputs.shape[0], inputs.shape[1]))
            return call(module, inputs, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", recorded)


Step = Callable[[], list[Any]]


def run(insert: Callable[[list[int], int], int], step: Step, end: Callable[[int], None],
        recorded: Recorded) -> tuple[dict[int, list[int]], list[str]]:
    """Drive a batch through `ARRIVALS`: each row's tokens by arrival, and the steps that
    ran more than one single-position pass."""
    out: dict[int, list[int]] = {}
    uids: dict[int, int] = {}
    live: set[int] = set()
    short: list[str] = []
    steps = 0
    while len(uids) < len(ARRIVALS) or live:
        for i, (at, limit) in enumerate(ARRIVALS):
            if at == steps and i not in uids:
                uids[i] = insert(prompt(i), limit)
                live.add(uids[i])
        first = len(recorded.calls)
        for response in step():
            out.setdefault(response.uid, []).append(response.token)
            if response.finish_reason is not None:
                live.discard(response.uid)
                end(response.uid)
        passes = [n for n, positions in recorded.calls[first:] if positions == 1]
        if len(passes) > 1:
            short.append(f"step {steps}: single-position passes of {passes} rows")
        steps += 1
    return {i: out[uid] for i, uid in uids.items()}, short


def orchard(source: str, recorded: Recorded) -> tuple[dict[int, list[int]], list[str]]:
    batch = LocalBatch(model(source), EngineConfig(prompt_cache_bytes=0))

    def insert(tokens: list[int], limit: int) -> int:
        row = Row(tuple(tokens), 0, limit, frozenset(), make_request_sampler(GREEDY))
        return batch.insert([row])[0][0]

    return run(insert, batch.step, lambda uid: batch.finish([Done(uid, keep=False)]),
               recorded)


def mlx_lm(source: str, recorded: Recorded) -> tuple[dict[int, list[int]], list[str]]:
    gen = BatchGenerator(model(source), completion_batch_size=32, prefill_batch_size=8)

    def insert(tokens: list[int], limit: int) -> int:
        return gen.insert([tokens], max_tokens=[limit])[0]

    return run(insert, lambda: gen.next()[1], lambda uid: None, recorded)


@pytest.mark.parametrize("source", SOURCES)
def test_a_joining_row_rides_in_the_batch_pass(source: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = Recorded(monkeypatch, type(model(source)))
    ours, short = orchard(source, recorded)
    theirs, their_short = mlx_lm(source, recorded)
    assert short == []
    # The check sees mlx-lm's own join: a pass of the joining rows alone.
    assert their_short, "mlx-lm's join was expected to run a pass of its own"
    assert ours == theirs
    assert [len(ours[i]) for i in range(len(ARRIVALS))] == [n for _, n in ARRIVALS]
