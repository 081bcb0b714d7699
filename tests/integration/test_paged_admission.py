"""Paged admission counts a shared prefix once (issue 58), on the real tiny model through
the whole engine (`ModelReplica`, admission in `replicas.engine.scheduling`, the budget in
`replicas.engine.kv.budget`): under a budget whose rows' blocks hold one long cached prefix
plus six short tails, but not six copies of the prefix, six requests that hit the prefix
all join the batch in one admission, where the padded batch admits two at a time; the text
is what each row gives alone; and MLX's memory stays within the budget plus the gathered
view and a step's activations, adding nothing like a copy of the prefix while they run.

The engine thread is held on a `call` while the requests queue, so all six reach one
admission whatever the machine's speed (no timing in the assertions)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any, Iterator

import mlx.core as mx
import pytest

from replicas.contract import Finished, GenerationRequest, SamplingParams, TextDelta, TokenPrompt
from replicas.engine.config import EngineConfig
from replicas.engine.kv.blocks import BLOCK_SIZE
from replicas.engine.kv.budget import KvBudget
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect, stream_events

PREFIX = [(11 * j) % 500 + 3 for j in range(40 * BLOCK_SIZE + 5)]  # 40 full blocks and 5
ROWS, TAIL, OUTPUT = 6, 7, 12
# In tokens of KV: the rows' share of the pool (64 blocks: the prefix's 41 and a block or
# two a row, not 6 x 41) and the prefix cache's (48 blocks: the prefix's entry); the budget
# is that, a scratch block a layer (`kv/pool_plan.py`) and the gather reserve (an eighth of
# it; a growth's transient comes out of the reserve, here its floor).
ROW_TOKENS, CACHE_TOKENS = 64 * BLOCK_SIZE, 48 * BLOCK_SIZE
BUDGET_TOKENS = -(-(ROW_TOKENS + CACHE_TOKENS + BLOCK_SIZE) * 8 // 7)
SLACK = 4 * 1024**2  # a decode step's activations and logits (test_paged_kv.py's)


def _per_token() -> int:
    probe = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny"))
    probe.start()
    try:
        return probe._engine.kv_budget.layout.per_token  # noqa: SLF001 - the model's own
    finally:
        probe.shutdown()


@pytest.fixture(scope="module")
def per_token() -> int:
    return _per_token()


def _replica(per_token: int, paged: bool) -> ModelReplica:
    engine = EngineConfig(kv_budget_bytes=BUDGET_TOKENS * per_token,
                          paged_kv="on" if paged else "off",
                          prompt_cache_bytes=CACHE_TOKENS * per_token)
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=engine))
    rep.start()
    return rep


def _request(rid: str, ids: list[int]) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="tiny", prompt=TokenPrompt(tuple(ids)),
                             sampling=SamplingParams(temperature=0.0, max_tokens=OUTPUT))


def _tail(i: int) -> list[int]:
    return [(37 * i + 5 * j) % 400 + 60 for j in range(TAIL)]


def _text(events: list[Any]) -> str:
    assert isinstance(events[-1], Finished), events[-1]
    return "".join(e.text for e in events if isinstance(e, TextDelta))


class _Watch:
    """What the engine's own scheduler saw, recorded on the engine thread: rows in the
    batch before each step, requests left waiting after each admission."""

    def __init__(self, rep: ModelReplica) -> None:
        self.rows: list[int] = []
        self.waiting: list[int] = []
        self.admitted: list[int] = []
        waiting = rep._engine._waiting  # noqa: SLF001 - observed, not replaced
        assert waiting is not None
        admit, grow = waiting.admit, waiting.grow

        def admitting(*args: Any, **kwargs: Any) -> Any:
            out = admit(*args, **kwargs)
            self.admitted.append(len(out))
            self.waiting.append(len(waiting))
            return out

        def growing(active: Any, *args: Any, **kwargs: Any) -> None:
            grow(active, *args, **kwargs)
            self.rows.append(len(active))

        waiting.admit, waiting.grow = admitting, growing  # type: ignore[method-assign]


async def _at_once(rep: ModelReplica, requests: list[GenerationRequest]) -> list[list[Any]]:
    """Run `requests` with all of them queued for the engine before it admits any."""
    engine = rep._engine  # noqa: SLF001
    gate = threading.Event()
    held = engine.call(lambda: gate.wait(120))  # the engine thread waits between steps
    tasks = [asyncio.create_task(collect(rep.stream(r))) for r in requests]
    deadline = time.monotonic() + 120  # generous: only a stuck replica takes this long
    while engine._commands.qsize() < len(requests):  # noqa: SLF001
        assert time.monotonic() < deadline, "the requests never reached the engine"
        await asyncio.sleep(0.01)
    gate.set()
    held.result(timeout=120)
    return list(await asyncio.gather(*tasks))


def _kv(rep: ModelReplica) -> KvBudget:
    return rep._engine.kv_budget  # noqa: SLF001


@pytest.fixture(scope="module")
def paged_run(per_token: int) -> Iterator[dict[str, Any]]:
    """The paged replica: the prefix seeded, the six rows at once, then each alone."""
    gc.collect()
    mx.synchronize()
    rep = _replica(per_token, paged=True)
    try:
        kv = _kv(rep)
        assert kv.paging is not None and kv.paging.blocks == ROW_TOKENS // BLOCK_SIZE
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        seeded = stream_events(rep, _request("seed", PREFIX + [9, 8, 7]))
        assert isinstance(seeded[-1], Finished)
        gc.collect()
        mx.synchronize()
        seeded_at = mx.get_active_memory()
        mx.reset_peak_memory()
        watch = _Watch(rep)
        together = asyncio.run(_at_once(
            rep, [_request(f"row-{i}", PREFIX + _tail(i)) for i in range(ROWS)]))
        peak = mx.get_peak_memory()
        gc.collect()
        mx.synchronize()
        after = mx.get_active_memory()
        stats = rep.stats()
        alone = [stream_events(rep, _request(f"alone-{i}", PREFIX + _tail(i)))
                 for i in range(ROWS)]
        yield dict(together=together, alone=alone, watch=watch, stats=stats, start=start,
                   seeded_at=seeded_at, peak=peak, after=after, kv=kv)
    finally:
        rep.shutdown()


def test_rows_sharing_a_cached_prefix_all_join_at_once(paged_run: dict[str, Any]) -> None:
    watch, stats = paged_run["watch"], paged_run["stats"]
    assert ROWS in watch.admitted, watch.admitted  # one admission took all six
    assert max(watch.rows) == ROWS and max(watch.waiting) == 0, (watch.rows, watch.waiting)
    assert stats.memory is not None and stats.memory.preempted == 0
    assert all(isinstance(e[-1], Finished) for e in paged_run["together"])
    # Each row was served the prefix from the cache (its blocks, shared).
    cached = [e[-1].usage.cached_tokens for e in paged_run["together"]]
    assert all(n >= len(PREFIX) for n in cached), cached
    # Six copies of the prefix's blocks would not fit the rows' share: sharing is counted.
    kv = paged_run["kv"]
    assert ROWS * kv.paging.blocks_for(len(PREFIX)) > kv.paging.blocks


def test_their_text_is_each_row_alone(paged_run: dict[str, Any]) -> None:
    assert [_text(e) for e in paged_run["together"]] == [_text(e) for e in paged_run["alone"]]


def test_mlx_memory_stays_within_the_budget(paged_run: dict[str, Any], per_token: int) -> None:
    """MLX's own figures: from the replica's start (weights only) the pool, the seeded
    prefix and the six rows stay within the budget plus the gathered view (rows x longest,
    one layer) and a step's activations; after the six rows (their entries kept by block
    refs) MLX holds about what it held with the prefix seeded: the pool is allocated once,
    and neither a hit nor a kept row copies the prefix."""
    kv: KvBudget = paged_run["kv"]
    assert kv.paging is not None
    budget = BUDGET_TOKENS * per_token
    view = ROWS * (len(PREFIX) + TAIL + OUTPUT) * kv.paging.gather_per_token
    prefix_bytes = len(PREFIX) * per_token
    grew = paged_run["peak"] - paged_run["start"]
    held = paged_run["after"] - paged_run["seeded_at"]
    print(f"budget {budget}, view {view}, prefix {prefix_bytes}: peak over the start {grew}; "
          f"held after the six rows over the seeded prefix {held}")
    assert grew <= budget + view + SLACK, (grew, budget + view + SLACK)
    assert held < prefix_bytes // 4, (held, prefix_bytes)
    assert paged_run["stats"].memory.projected_bytes == 0  # every reservation released


def test_the_padded_batch_admits_fewer(per_token: int, paged_run: dict[str, Any]) -> None:
    """The same budget on the padded batch (each row padded to the longest, in 256-token
    steps): two rows at a time, the rest wait; the text is the paged batch's."""
    rep = _replica(per_token, paged=False)
    try:
        stream_events(rep, _request("seed", PREFIX + [9, 8, 7]))
        watch = _Watch(rep)
        together = asyncio.run(_at_once(
            rep, [_request(f"row-{i}", PREFIX + _tail(i)) for i in range(ROWS)]))
        assert max(watch.rows) < ROWS and max(watch.waiting) > 0, (watch.rows, watch.waiting)
        assert [_text(e) for e in together] == [_text(e) for e in paged_run["together"]]
    finally:
        rep.shutdown()
