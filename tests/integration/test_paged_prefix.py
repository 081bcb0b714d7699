"""The prefix cache sharing the paged batch's blocks (`replicas.engine.kv.rows`,
`PromptCache.attach`), on real tiny models: rows hitting one cached prefix, joining and
leaving mid-stream, give mlx-lm's greedy text token for token; saving and hitting entries
adds no KV bytes to what MLX holds (`mx.get_active_memory`); eviction brings every block
back; and the pool asks the cache for blocks when a row needs them."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any
import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from replicas.contract import Finished, GenerationRequest, SamplingParams, TextDelta, TokenPrompt
from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Done, Row
from replicas.engine.config import EngineConfig
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.disk import DiskTier
from replicas.engine.kv.layout import measure_kv
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_paged_kv import GREEDY, model
from tests.streams import collect

# A system prompt that ends inside a block (70 = 2 x 32 + 6): every hit shares its partial
# last block, which each row copies before its first write.
SYSTEM = [(13 * j) % 500 + 3 for j in range(70)]
# (step it joins at, its own tokens after the prefix, tokens it decodes)
ARRIVALS = [(0, 3, 12), (0, 9, 7), (2, 1, 10), (4, 20, 6), (4, 5, 14), (9, 2, 8)]


def _batch(name: str, cache_bytes: int = 16 * 1024**2, budget: int = 64 * 1024**2,
           disk: DiskTier | None = None) -> tuple[LocalBatch, KvBudget]:
    m = model(name)
    batch = LocalBatch(m, EngineConfig(prompt_cache_bytes=cache_bytes, paged_kv="on"),
                       disk=disk)
    kv = KvBudget(budget, measure_kv(m), 64)
    batch.page(kv, 32768)
    assert kv.paging is not None and kv.blocks is not None and batch.cache is not None
    return batch, kv


def _row(tokens: list[int], limit: int, boundary: int = 0) -> Row:
    return Row(tuple(tokens), boundary, limit, frozenset(), make_request_sampler(GREEDY))


def _question(i: int, n: int) -> list[int]:
    return [(29 * i + 7 * j) % 500 + 3 for j in range(n)]


def _drain(batch: LocalBatch, uids: list[int], keep: bool = True) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {u: [] for u in uids}
    while not batch.empty:
        for r in batch.step():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                batch.finish([Done(r.uid, keep=keep)])
    return out


def _seed_system(batch: LocalBatch) -> None:
    """One conversation whose message boundary is the system prompt: the cache keeps it."""
    [(uid, _)] = batch.insert([_row(SYSTEM + _question(99, 4), 3, len(SYSTEM))])
    _drain(batch, [uid])


def _theirs(name: str, prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
    gen = BatchGenerator(model(name), completion_batch_size=32, prefill_batch_size=8)
    uids = gen.insert(prompts, max_tokens=limits)
    want: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(want[u]) < n for u, n in zip(uids, limits)):
        for r in gen.next()[1]:
            want[r.uid].append(r.token)
    return [want[u] for u in uids]


@pytest.mark.parametrize("name", ["builtin:tiny", "qwen3"])
def test_rows_sharing_a_cached_prefix_give_mlx_lms_text(name: str) -> None:
    rows_hitting_the_system_prompt_give_mlx_lms_text(name, shared_blocks=3)


def rows_hitting_the_system_prompt_give_mlx_lms_text(
        name: str, shared_blocks: int) -> tuple[LocalBatch, KvBudget]:
    """The system prompt cached, then ARRIVALS joining mid-stream: every row hits it, at
    least `shared_blocks` of its blocks are read in place, and the text is mlx-lm's. The
    batch and its budget, afterwards."""
    batch, kv = _batch(name)
    _seed_system(batch)
    prompts = [SYSTEM + _question(i, n) for i, (_, n, _) in enumerate(ARRIVALS)]
    uids: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    served: dict[int, int] = {}
    shared_while_running = 0
    step = 0
    while len(uids) < len(ARRIVALS) or not batch.empty:
        for i, (at, _, limit) in enumerate(ARRIVALS):
            if at == step:
                [(uid, n)] = batch.insert([_row(prompts[i], limit)])
                uids[i], served[i] = uid, n
        for r in batch.step():
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                batch.finish([Done(r.uid, keep=True)])
        shared_while_running = max(shared_while_running, kv.blocks().shared)  # type: ignore[misc]
        step += 1
    assert all(n >= len(SYSTEM) for n in served.values()), served  # every row hit it
    assert shared_while_running >= shared_blocks  # the system prompt's blocks, read in place
    want = _theirs(name, prompts, [limit for _, _, limit in ARRIVALS])
    assert [out[uids[i]] for i in range(len(ARRIVALS))] == want
    return batch, kv


def test_hits_and_saves_add_no_kv_bytes() -> None:
    """Measured by MLX: four rows hitting a cached 1,285-token prefix decode together in a
    pool smaller than four copies of it, and neither their hits nor the entries saved as
    they end add to the memory MLX holds (the pool's arrays are allocated once, at the
    first write: a copy of the prefix anywhere else would show)."""
    batch, kv = _batch("builtin:tiny", budget=4 * 1024**2)
    pool = batch._pool
    assert pool is not None
    prefix = [(11 * j) % 500 + 3 for j in range(40 * 32 + 5)]
    [(uid, _)] = batch.insert([_row(prefix + [7, 8], 4, len(prefix))])
    _drain(batch, [uid])
    prefix_bytes = measure_kv(model("builtin:tiny")).per_token * len(prefix)
    assert 4 * prefix_bytes > pool.nbytes  # four copies could not be held
    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()
    served = batch.insert([_row(prefix + _question(i, 3 + i), 6) for i in range(4)])
    assert all(n >= len(prefix) for _, n in served), served
    for _ in range(3):  # every row prefilled its few tokens and decodes
        batch.step()
    gc.collect()
    mx.synchronize()
    live = mx.get_active_memory() - before
    _drain(batch, [u for u, _ in served])
    gc.collect()
    mx.synchronize()
    added = mx.get_active_memory() - before
    print(f"prefix {prefix_bytes} bytes, pool {pool.nbytes}: four live hits added {live}, "
          f"with their four entries saved {added}")
    assert live < prefix_bytes // 4 and added < prefix_bytes // 4, (live, added, prefix_bytes)
    assert batch.cache is not None and batch.cache.stats().entries >= 4


def test_eviction_brings_every_block_back() -> None:
    batch, kv = _batch("builtin:tiny")
    _seed_system(batch)
    uids = [u for u, _ in batch.insert([_row(SYSTEM + _question(i, 5), 5) for i in range(3)])]
    _drain(batch, uids)
    stats = kv.blocks()  # type: ignore[misc]
    assert stats.shared > 0 and stats.used == stats.shared  # only the cache holds blocks
    assert batch.cache is not None
    batch.cache.evict_to(0)
    stats = kv.blocks()  # type: ignore[misc]
    assert stats.used == 0 and stats.shared == 0 and stats.free == stats.total
    pool = batch._pool
    assert pool is not None and pool.cache_only == 0
    assert all(pool.layer(i).multi == 0 for i in range(len(pool._layers)))
    assert batch.cache.nbytes == 0


def test_a_row_short_of_blocks_evicts_the_cache() -> None:
    """The cache holding half the pool (its share): a row longer than the other half gets
    its blocks from the oldest entries (no `PoolExhausted`), and its text is mlx-lm's."""
    batch, kv = _batch("builtin:tiny", cache_bytes=64 * 1024**2, budget=4 * 1024**2)
    assert batch._pool is not None and batch.cache is not None
    total = batch._pool.num_blocks  # 56 blocks for rows, 56 for the cache (tiny: 1 KiB/token)
    for i in range(2):
        [(uid, _)] = batch.insert([_row(_question(50 + i, 860), 1)])
        _drain(batch, [uid])
    free = kv.blocks().free  # type: ignore[misc]
    long = _question(7, total * 32 - 600)
    assert free < batch._pool.blocks_for(len(long)) < total
    [(uid, _)] = batch.insert([_row(long, 5)])
    got = _drain(batch, [uid], keep=False)[uid]
    assert got == _theirs("builtin:tiny", [long], [5])[0]
    assert batch.cache.stats().evictions >= 1


def test_the_disk_tier_gets_copies_and_its_entries_join_as_blocks(tmp_path: Path) -> None:
    """An entry by blocks is written to the disk tier as a copy (its blocks may go back
    meanwhile); read back after its eviction, it is copied into blocks, and the next
    turn hits it with mlx-lm's text."""
    disk = DiskTier(tmp_path, 1 << 30, "tiny")
    try:
        batch, kv = _batch("builtin:tiny", disk=disk)
        cache = batch.cache
        assert cache is not None
        prompt = SYSTEM + _question(1, 40)
        [(uid, _)] = batch.insert([_row(prompt, 6)])
        answer = _drain(batch, [uid])[uid]
        assert disk.flush() and len(disk) >= 1
        cache.evict_to(0)
        assert kv.blocks().used == 0  # type: ignore[misc]
        second = prompt + answer + _question(2, 5)
        found = cache.disk_wanted(second)
        assert found is not None
        layers = cache.read_disk(found)
        assert layers is not None
        cache.take_disk(found, layers)
        assert kv.blocks().shared >= batch._pool.blocks_for(len(prompt))  # type: ignore
        [(uid, served)] = batch.insert([_row(second, 8)])
        assert served >= len(prompt) + len(answer) - 1
        got = _drain(batch, [uid], keep=False)[uid]
        assert got == _theirs("builtin:tiny", [second], [8])[0]
    finally:
        disk.close()


def test_a_preempted_row_resumes_from_its_own_blocks() -> None:
    """Preemption (the engine's `finish(keep=True)` mid-stream) parks the row's blocks in
    the prefix cache by ref, no copy; resumed with what it streamed, it hits them and its
    text is mlx-lm's for the whole answer."""
    batch, kv = _batch("builtin:tiny")
    prompt = SYSTEM + _question(3, 17)
    [(uid, _)] = batch.insert([_row(prompt, 20)])
    streamed: list[int] = []
    while len(streamed) < 7:
        streamed += [r.token for r in batch.step()]
    held = len(batch._gen._generation_batch.prompt_cache[0].tables[0])
    batch.finish([Done(uid, keep=True)])
    blocks = kv.blocks()  # type: ignore[misc]
    # The row's blocks are the cache's now (its prompt's entry, a prefix of it, is gone).
    assert batch.empty and blocks.used == blocks.shared == held
    [(uid, served)] = batch.insert([_row(prompt + streamed, 20 - len(streamed))])
    assert served == len(prompt) + len(streamed) - 1
    rest = _drain(batch, [uid])[uid]
    assert streamed + rest == _theirs("builtin:tiny", [prompt], [20])[0]


def test_agent_turns_through_the_engine_match_the_padded_replica() -> None:
    """Through the whole engine (admission, growth, the prefix cache's bound): six
    conversations on one system prompt, two turns each, all at once under a tight budget,
    give the padded replica's text with the cache off; second turns hit their first's
    blocks and nothing fails."""
    def replica(paged: bool) -> ModelReplica:
        engine = EngineConfig(kv_budget_bytes=2 * 1024**2, paged_kv="on" if paged else "off",
                              prompt_cache_bytes=1024**2 if paged else 0)
        rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                          engine=engine))
        rep.start()
        return rep

    def request(rid: str, ids: list[int]) -> GenerationRequest:
        return GenerationRequest(request_id=rid, model="tiny", prompt=TokenPrompt(tuple(ids)),
                                 sampling=SamplingParams(temperature=0.0, max_tokens=24))

    async def turns(rep: ModelReplica, prompts: list[list[int]]) -> list[list[Any]]:
        return [list(e) for e in await asyncio.gather(
            *(collect(rep.stream(request(f"r{i}-{len(p)}", p))) for i, p in enumerate(prompts)))]

    def text(events: list[Any]) -> str:
        assert isinstance(events[-1], Finished), events[-1]
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    firsts = [SYSTEM + _question(i, 6 + i) for i in range(6)]
    # A second turn: the first and more tokens (the cached first turn serves its prompt).
    seconds = [p + _question(40 + i, 12) for i, p in enumerate(firsts)]
    answers: dict[bool, list[str]] = {}
    for paged in (True, False):
        rep = replica(paged)
        try:
            answers[paged] = [text(e) for prompts in (firsts, seconds)
                              for e in asyncio.run(turns(rep, prompts))]
            if paged:
                stats = rep.stats()
                assert stats.cache_hits >= 6 and stats.memory is not None
                assert stats.memory.blocks is not None and stats.memory.blocks.shared > 0
        finally:
            rep.shutdown()
    assert answers[True] == answers[False]
