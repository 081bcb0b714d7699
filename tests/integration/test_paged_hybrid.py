"""Paged KV for models whose other layers are not plain attention (`kv/rows.py`
`paged_layers`): their full-attention layers page, their sliding-window layers stay on
mlx-lm's `BatchRotatingKVCache` and their recurrent / SSM layers on its `ArraysCache`, one
fixed slot a row. On the built-in architecture models: `arch-sliding` (gpt-oss, 64-token
windows beside full layers, attention sinks), `arch-linear` (Qwen3-Next, linear attention
beside one full layer) and `arch-ssm` (Nemotron-H, Mamba-2 beside one attention layer), `arch-kimi-linear` (Kimi
Delta Attention beside one MLA layer, its latent in a plain `KVCache`):
greedy text identical to mlx-lm's own `BatchGenerator`, rows of mixed lengths (past the
window) joining and leaving mid-stream, a prefix cache hit, and the pool holding exactly
the full-attention layers. And Gemma 3 with images (`builtin:vision-gemma3`: sliding and
full layers) against mlx-vlm."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Done, Row
from replicas.engine.config import EngineConfig
from replicas.engine.kv import attention
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.layout import measure_kv
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.sources import resolve_source
from tests.integration.test_paged_kv import GREEDY, model, paged_batch, run
from tests.integration.test_paged_prefix import rows_hitting_the_system_prompt_give_mlx_lms_text

HYBRIDS = ["builtin:arch-sliding", "builtin:arch-linear", "builtin:arch-ssm",
           "builtin:arch-kimi-linear"]
# (step it joins at, prompt tokens, tokens it decodes): mixed lengths, two past the
# sliding window (64) and several blocks (32) long, joining and leaving mid-stream.
ARRIVALS = [(0, 150, 12), (0, 9, 20), (3, 40, 16), (5, 90, 10), (5, 5, 24), (11, 70, 8),
            (14, 30, 6)]
BATCH_FORM = {RotatingKVCache: "BatchRotatingKVCache", ArraysCache: "ArraysCache"}


def _prompt(i: int, n: int) -> list[int]:
    return [(41 * i + 13 * j) % 500 + 3 for j in range(n)]


def _arrivals() -> list[tuple[int, list[int], int]]:
    return [(at, _prompt(i, n), limit) for i, (at, n, limit) in enumerate(ARRIVALS)]


def _batch_form(layer: Any) -> str:
    if type(layer) is KVCache:
        return "PagedBatchKVCache"
    return next(form for kind, form in BATCH_FORM.items() if isinstance(layer, kind))


@pytest.mark.parametrize("name", HYBRIDS)
def test_full_attention_pages_and_the_text_is_mlx_lms(name: str) -> None:
    m = model(name)
    fresh = make_prompt_cache(m)
    assert {type(c) for c in fresh} - {KVCache}  # a hybrid: some layers are not plain KV
    want_forms = [_batch_form(c) for c in fresh]
    batch, kv = paged_batch(m, 64 * 1024**2)
    assert kv.paging is not None and kv.blocks is not None
    layout = kv.layout
    # Admission counts each row's fixed cost in the layers that do not page.
    assert kv.paging.row_bytes == layout.bytes_for(0) + sum(
        per * window for window, per in layout.windows) > 0

    def insert(tokens: list[int], limit: int) -> int:
        row = Row(tuple(tokens), 0, limit, frozenset(), make_request_sampler(GREEDY))
        return batch.insert([row])[0][0]

    forms: set[tuple[str, ...]] = set()
    used: list[int] = []
    per_row: list[float] = []  # what the other layers hold a decoding row, by mlx-lm

    def on_step() -> None:
        decoding = batch._gen._generation_batch
        caches = decoding.prompt_cache
        if caches:
            forms.add(tuple(type(c).__name__ for c in caches))
            other = sum(c.nbytes for c, kind in zip(caches, want_forms)
                        if kind != "PagedBatchKVCache")
            per_row.append(other / len(decoding.uids))
        used.append(kv.blocks().used)  # type: ignore[misc]

    ours = run(insert, batch.step, lambda uid: batch.finish([Done(uid, keep=False)]),
               _arrivals(), on_step)
    assert forms == {tuple(want_forms)}  # every step: full attention paged, others mlx-lm's
    # The pool holds the full-attention layers, and only those.
    assert batch._pool is not None
    assert sorted(batch._pool._layers) == [i for i, c in enumerate(fresh) if type(c) is KVCache]
    assert max(used) >= sum(-(-(n + limit) // 32) for _, n, limit in ARRIVALS[:2])
    assert attention.hooked(m)
    assert 0 < max(per_row) <= kv.paging.row_bytes  # admission's fixed cost a row holds

    gen = BatchGenerator(m, completion_batch_size=32, prefill_batch_size=8)
    theirs = run(lambda t, n: gen.insert([t], max_tokens=[n])[0], lambda: gen.next()[1],
                 lambda uid: None, _arrivals())
    assert ours == theirs
    assert [len(ours[i]) for i in range(len(ARRIVALS))] == [n for _, _, n in ARRIVALS]
    assert batch.empty
    blocks = kv.blocks()  # type: ignore[misc]
    assert blocks.used == 0 and blocks.free == blocks.total  # every row gave its blocks back


@pytest.mark.parametrize("name", HYBRIDS)
def test_rows_hitting_a_cached_prefix_give_mlx_lms_text(name: str) -> None:
    """The system prompt kept at its message boundary (a hybrid's entry is served whole:
    its recurrent state cannot be trimmed), then rows joining mid-stream hit it: their
    full-attention layers share its blocks, their other layers start from its state."""
    batch, kv = rows_hitting_the_system_prompt_give_mlx_lms_text(name, shared_blocks=2)
    assert batch.cache is not None
    batch.cache.evict_to(0)
    assert kv.blocks().used == 0  # type: ignore[misc]


def test_admission_counts_the_fixed_cost_of_each_row() -> None:
    """A row reserves its blocks and its layers' fixed cost; the budget keeps that cost's
    room for `max_batch_size` rows."""
    m = model("builtin:arch-linear")
    batch, kv = paged_batch(m, 64 * 1024**2, max_batch_size=6)
    p = kv.paging
    assert p is not None and p.rows == 6
    bound = lambda n: None  # noqa: E731 - no prefix cache
    assert kv.reserve("a", 100, bound)
    assert kv.projected == p.blocks_for(100) * p.block_bytes + p.row_bytes
    for i in range(5):
        assert kv.reserve(i, 10, bound)
    assert not kv.reserve("one too many", 10, bound)  # the fixed room holds six rows


@pytest.mark.parametrize("name", ["builtin:arch-longcat"])
def test_models_that_still_do_not_page_say_why(name: str) -> None:
    """A `CacheList` layer (LongCat's two attentions a layer) keeps the padded batch: `auto`
    says why in the log, `on` refuses."""
    m = model(name)
    with pytest.raises(ValueError, match="CacheList"):
        paged_batch(m, 64 * 1024**2)
    auto = LocalBatch(m, EngineConfig(prompt_cache_bytes=0, paged_kv="auto"))
    kv = KvBudget(64 * 1024**2, measure_kv(m), 64)
    auto.page(kv, 32768)
    assert kv.paging is None


def test_gemma3_with_images_pages_and_answers_as_mlx_vlm() -> None:
    """A sliding-window hybrid served with images (`builtin:vision-gemma3`), paged: rows
    with 0, 1 and 2 images batched with text rows, each image prefilled under Gemma's
    image mask in 3-token steps, answer as mlx-vlm's Gemma does."""
    from mlx_vlm import load

    from tests.integration.test_vision_gemma import (
        GEMMA3, answers, masked_generate, replica_with, requests)

    vlm, processor = load(str(resolve_source(GEMMA3.source)))
    want = [masked_generate(vlm, processor, r) for r in requests()]
    rep = replica_with(GEMMA3, paged_kv="on", prompt_cache_bytes=0, prefill_step_size=3)
    try:
        assert rep._batch is not None and rep._batch._pool is not None  # noqa: SLF001
        got = answers(rep, requests())
        assert rep._batch._pool._layers  # noqa: SLF001 - the full-attention layers wrote
    finally:
        rep.shutdown()
    assert got == want


def test_lfm2_with_images_pages_and_answers_as_mlx_vlm() -> None:
    """A convolution-state hybrid served with images (`builtin:vision-lfm2`: `ArraysCache`
    beside full attention), paged, the image prefix in 3-token chunks carrying the
    convolution's state: each row answers as mlx-vlm's own generation."""
    from replicas.engine.config import EngineConfig as Engine
    from replicas.replica import ModelReplica, ReplicaOptions
    from tests.integration import test_vision_lfm2 as lfm2

    generate = lfm2.reference.__wrapped__()  # the module's fixture, called as a function
    want = [generate(r) for r in lfm2.requests()]
    rep = ModelReplica(ReplicaOptions(model_id="vl", source=lfm2.SOURCE, engine=Engine(
        prefill_step_size=3, prompt_cache_bytes=0, paged_kv="on")))
    rep.start()
    try:
        assert rep._batch is not None and rep._batch._pool is not None  # noqa: SLF001
        got = lfm2.answers(rep, lfm2.requests())
    finally:
        rep.shutdown()
    assert got == want
