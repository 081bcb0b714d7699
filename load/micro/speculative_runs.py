"""The engines `load/micro/speculative.py` compares, one batch each: raw mlx-lm's
`BatchGenerator` and Orchard's `LocalBatch`, driven step by step over the same prompts,
with their tokens and timings; and how two runs' outputs differ."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from load.harness.prompts import WORDS
from replicas.contract import SamplingParams
from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Row
from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.engine.sampling.penalties import Penalties
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.engine.spec.gate import SpeculationGate


@dataclass
class BatchRun:
    """One engine's run of one batch."""

    tokens: int  # emitted after the first step that emitted any
    seconds: float  # since that step
    total_tokens: int
    passes: int = 0  # Orchard only, from `decode_counts()` over the whole run
    counted: int = 0  # tokens `decode_counts()` saw
    drafted: int = 0
    accepted: int = 0
    rows_off_path: int = 0
    wall: float = 0.0  # the whole run, prefill included

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


Outputs = dict[int, list[int]]  # row index -> its tokens


def prompts(loaded: Any, rows: int, words: int, seed: int) -> list[list[int]]:
    """Distinct short prompts, a numbered random sentence each (no chat template: on this
    CPU a prompt token costs about what a decoded one does, and prefill is not measured)."""
    rng = random.Random(seed)
    return [list(loaded.tokenizer.encode(
        f"{i}. " + " ".join(rng.choice(WORDS) for _ in range(words)))) for i in range(rows)]


def copy_prompts(loaded: Any, batch: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt, then the model's own greedy answer to it (`tokens` long), then the prompt
    again: a request that re-types what its context holds, as a coding agent re-emits a
    file it read. A model whose next token depends on its recent tokens alone (`mtp-bench`'s
    inert layers) answers the repeat with the same answer, so prompt-lookup drafts all hit;
    on a model that reads its whole context, how often they hit is the acceptance column."""
    _, answers = run_raw(loaded, batch, tokens, 0.0)
    return [ids + answers[i] + ids for i, ids in enumerate(batch)]


def drive(step: Callable[[], list[Any]], done: Callable[[], bool], uids: list[int],
          ) -> tuple[BatchRun, Outputs]:
    """Step until every row ended; the clock starts after the first step with tokens."""
    index = {uid: i for i, uid in enumerate(uids)}
    outputs: Outputs = {i: [] for i in range(len(uids))}
    start = None
    tokens = 0
    while not done():
        responses = step()
        for r in responses:
            outputs[index[r.uid]].append(r.token)
        if start is None:
            if responses:
                start = time.perf_counter()
            continue
        tokens += len(responses)
    seconds = time.perf_counter() - start if start is not None else 0.0
    return BatchRun(tokens, seconds, sum(map(len, outputs.values()))), outputs


def run_raw(loaded: Any, batch: list[list[int]], max_tokens: int, temperature: float,
            bias: dict[int, float] | None = None) -> tuple[BatchRun, Outputs]:
    """Plain mlx-lm; `bias` on row 0 as mlx-lm's own logits processor."""
    n = len(batch)
    gen = BatchGenerator(loaded.model, completion_batch_size=max(n, 32), prefill_batch_size=n,
                         sampler=make_sampler(temp=temperature))
    processors = [make_logits_processors(logit_bias=bias) if bias and i == 0 else []
                  for i in range(n)]
    uids = gen.insert(batch, max_tokens=[max_tokens] * n, logits_processors=processors)
    live = set(uids)

    def step() -> list[Any]:
        _, responses = gen.next()
        live.difference_update(r.uid for r in responses if r.finish_reason is not None)
        return responses

    try:
        return drive(step, lambda: not live, uids)
    finally:
        gen.close()


def run_orchard(loaded: Any, batch: list[list[int]], max_tokens: int, temperature: float,
                speculative: SpeculativeConfig | None, bias: dict[int, float] | None = None,
                draft: Any = None, gate: SpeculationGate | None = None) -> tuple[BatchRun, Outputs]:
    """`LocalBatch`, rows as `scheduling.row_for` builds them; `bias` on row 0; `draft`:
    the draft model (`--draft-model`), when speculating; `gate`: the speculation gate's
    measurements of earlier runs (a server's engine keeps its own for its lifetime)."""
    n = len(batch)
    local = LocalBatch(loaded.model, EngineConfig(
        max_batch_size=max(n, 32), prefill_batch_size=n, prompt_cache_bytes=0,
        speculative=speculative), draft=draft if speculative is not None else None, gate=gate)
    rows = []
    for i, ids in enumerate(batch):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                logit_bias=bias if bias and i == 0 else {})
        penalties = Penalties.of(params)
        rows.append(Row(tuple(ids), 0, max_tokens, frozenset(), make_request_sampler(params),
                        (penalties,) if penalties is not None else ()))
    uids = [uid for uid, _ in local.insert(rows)]
    run, outputs = drive(local.step, lambda: local.empty, uids)
    counts = local.decode_counts()
    local.close()
    run.passes, run.counted = counts.passes, counts.tokens
    run.drafted, run.accepted = counts.drafted, counts.accepted
    run.rows_off_path = counts.rows_off_path
    return run, outputs


TIES: list[str] = []  # rows that parted where the model's top two logits were equal


def tied(loaded: Any, context: list[int], x: int, y: int) -> bool:
    """Whether tokens x and y have the same logit after `context`, to one step of the
    model's dtype, in a one-row forward: then which one a batch picks is rounding (the
    order of a sum), not an error."""
    logits = loaded.model(mx.array([context]))[0, -1]
    a, b = (float(logits[t].astype(mx.float32).item()) for t in (x, y))
    bits = {mx.bfloat16: 8, mx.float16: 11}.get(logits.dtype, 24)  # mantissa bits
    return abs(a - b) <= 2.0 ** (math.floor(math.log2(max(abs(a), abs(b), 1e-30))) - bits + 1)


def mismatch(name: str, a: Outputs, b: Outputs, loaded: Any = None,
             batch: list[list[int]] | None = None) -> list[str]:
    """Rows whose tokens differ, with where; given the model and prompts, a row whose
    outputs part where the model's top two logits tie is listed in `TIES` instead."""
    lines = []
    for i in sorted(a):
        if a[i] != b[i]:
            at = next((j for j, (x, y) in enumerate(zip(a[i], b[i])) if x != y),
                      min(len(a[i]), len(b[i])))
            line = (f"  {name}: row {i} differs at token {at} of {len(a[i])}/{len(b[i])}: "
                    f"{a[i][max(0, at - 3):at + 5]} vs {b[i][max(0, at - 3):at + 5]}")
            if (loaded is not None and batch is not None and at < min(len(a[i]), len(b[i]))
                    and tied(loaded, batch[i] + a[i][:at], a[i][at], b[i][at])):
                TIES.append(line + " (tied logits)")
            else:
                lines.append(line)
    return lines
