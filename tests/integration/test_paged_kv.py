"""Paged KV (`replicas.engine.kv.paged`) in the engine's batch, on real tiny models: greedy
text identical to mlx-lm's own `BatchGenerator`, rows of mixed lengths joining and leaving
mid-stream; one long row among short ones decoding together under a budget the padded
batch could not hold; and MLX's peak memory within the budget plus the reserve.

Full-attention architectures: `builtin:tiny` (Llama, GQA), `builtin:pipe` (Qwen2), and
random-weight Qwen3 dense, Qwen3-MoE and a 4-bit-weight Qwen3 built from mlx-lm's own
classes (the built-in matrix has no plain-attention MoE or quantized model), and MLA
(`builtin:arch-mla`). Hybrids (sliding windows, linear attention, SSM):
`test_paged_hybrid.py`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import qwen3, qwen3_moe

from replicas.contract import SamplingParams
from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Done, Row
from replicas.engine.config import EngineConfig
from replicas.engine.kv import attention
from replicas.engine.kv import paged as paged_module
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.layout import measure_kv
from replicas.engine.model.loading import load_model
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.sources import resolve_source

GREEDY = SamplingParams(temperature=0.0)
# (step it joins at, tokens it decodes): rows of mixed lengths join and leave mid-stream.
ARRIVALS = [(0, 24), (0, 9), (3, 20), (5, 16), (5, 12), (11, 18), (14, 6)]
_QWEN3: dict[str, Any] = dict(
    model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False,
    max_position_embeddings=32768)


def _random(module: nn.Module, seed: int) -> nn.Module:
    mx.random.seed(seed)
    module.update(nn.utils.tree_map(lambda a: mx.random.normal(a.shape) * 0.2  # type: ignore
                                    if isinstance(a, mx.array) else a, module.parameters()))
    mx.eval(module.parameters())
    return module


@lru_cache(maxsize=None)
def model(name: str) -> nn.Module:
    if name.startswith("builtin:"):
        return load_model(name, resolve_source(name)).model
    if name == "qwen3":
        return _random(qwen3.Model(qwen3.ModelArgs(**_QWEN3)), 1)
    if name == "qwen3-moe":
        return _random(qwen3_moe.Model(qwen3_moe.ModelArgs(
            **_QWEN3 | dict(model_type="qwen3_moe"), num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=64,
            norm_topk_prob=True)), 2)
    if name == "qwen3-4bit":
        m = _random(qwen3.Model(qwen3.ModelArgs(**_QWEN3)), 3)
        nn.quantize(m, group_size=32, bits=4)
        mx.eval(m.parameters())
        return m
    raise KeyError(name)


# `builtin:arch-mla` (DeepSeek V3): MLA's absorbed latent is a plain `KVCache`, so it pages.
MODELS = ["builtin:tiny", "builtin:pipe", "qwen3", "qwen3-moe", "qwen3-4bit",
          "builtin:arch-mla"]


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 500 + 3 for j in range(5 + 9 * i)]


def paged_batch(m: nn.Module, budget: int, **config: Any) -> tuple[LocalBatch, KvBudget]:
    batch = LocalBatch(m, EngineConfig(prompt_cache_bytes=0, paged_kv="on", **config))
    kv = KvBudget(budget, measure_kv(m), 64)
    batch.page(kv, 32768)
    assert kv.paging is not None and kv.blocks is not None
    return batch, kv


def run(insert: Callable[[list[int], int], int], step: Callable[[], list[Any]],
        end: Callable[[int], None], arrivals: Sequence[tuple[int, list[int], int]] | None = None,
        on_step: Callable[[], None] = lambda: None) -> dict[int, list[int]]:
    """Each of `arrivals` (step it joins at, prompt, tokens it decodes; ARRIVALS by default)
    inserted at its step, rows ended as they finish: each one's tokens, by arrival."""
    if arrivals is None:
        arrivals = [(at, prompt(i), limit) for i, (at, limit) in enumerate(ARRIVALS)]
    out: dict[int, list[int]] = {}
    uids: dict[int, int] = {}
    live: set[int] = set()
    steps = 0
    while len(uids) < len(arrivals) or live:
        for i, (at, tokens, limit) in enumerate(arrivals):
            if at == steps and i not in uids:
                uids[i] = insert(tokens, limit)
                live.add(uids[i])
        for response in step():
            out.setdefault(response.uid, []).append(response.token)
            if response.finish_reason is not None:
                live.discard(response.uid)
                end(response.uid)
        on_step()
        steps += 1
    return {i: out[uid] for i, uid in uids.items()}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_text_is_mlx_lms(name: str) -> None:
    _greedy_text_is_mlx_lms(name)


@pytest.mark.parametrize("name", ["builtin:tiny", "qwen3-moe"])
def test_greedy_text_is_mlx_lms_with_rows_grouped_by_length(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step whose rows differ in width attends by groups (a group costing
    nothing): rows of mixed lengths joining and leaving, the text still mlx-lm's."""
    monkeypatch.setattr(attention, "GROUP_COST", 0)
    grouped: list[int] = []
    real = paged_module.attend_groups

    def attend_groups(*args: Any) -> mx.array:
        grouped.append(len(args[3]))
        return real(*args)

    monkeypatch.setattr(paged_module, "attend_groups", attend_groups)
    _greedy_text_is_mlx_lms(name)
    assert attention.hooked(model(name))
    assert max(grouped) >= 3, grouped  # steps with three widths and more went by group


def _greedy_text_is_mlx_lms(name: str) -> None:
    m = model(name)
    batch, kv = paged_batch(m, 64 * 1024**2)

    def insert(tokens: list[int], limit: int) -> int:
        row = Row(tuple(tokens), 0, limit, frozenset(), make_request_sampler(GREEDY))
        return batch.insert([row])[0][0]

    kinds: set[str] = set()

    def step() -> list[Any]:
        responses = batch.step()
        kinds.update(type(c).__name__ for c in batch._gen._generation_batch.prompt_cache)
        return responses

    ours = run(insert, step, lambda uid: batch.finish([Done(uid, keep=False)]))
    assert kinds == {"PagedBatchKVCache"}
    gen = BatchGenerator(m, completion_batch_size=32, prefill_batch_size=8)
    theirs = run(lambda t, n: gen.insert([t], max_tokens=[n])[0], lambda: gen.next()[1],
                 lambda uid: None)
    assert ours == theirs
    assert [len(ours[i]) for i in range(len(ARRIVALS))] == [n for _, n in ARRIVALS]
    assert batch.empty
    blocks = kv.blocks()  # type: ignore[misc]
    assert blocks.used == 0 and blocks.free == blocks.total  # every row gave its blocks back


def test_unqualified_models_say_why() -> None:
    m = model("builtin:tiny")
    with pytest.raises(ValueError, match="kv_bits"):
        paged_batch(m, 64 * 1024**2, kv_bits=8)
    auto = LocalBatch(model("builtin:tiny"), EngineConfig(prompt_cache_bytes=0, paged_kv="auto",
                                                          kv_bits=8))
    kv = KvBudget(64 * 1024**2, measure_kv(m), 64)
    auto.page(kv, 32768)
    assert kv.paging is None  # auto: the padded batch


LONG, SHORT, ROWS = 8192, 96, 16


def _long_and_short(budget_tokens: float) -> tuple[list[list[int]], int]:
    m = model("builtin:tiny")
    per_token = measure_kv(m).per_token
    prompts = [prompt(1) * (LONG // len(prompt(1)) + 1)][:1]
    prompts = [prompts[0][:LONG]] + [[(7 * i + j) % 500 + 3 for j in range(SHORT)]
                                     for i in range(ROWS - 1)]
    return prompts, int(budget_tokens * per_token)


def _until_it_decodes(batch: LocalBatch) -> int:
    """Step until the batch's rows have a token (a long prompt prefills a chunk a step)."""
    while not (responses := batch.step()):
        pass
    return len(responses)


def test_a_long_row_among_short_ones_decodes_with_them() -> None:
    """One 8k-token row and 15 short ones under a budget of 1.5x their summed lengths:
    admission by blocks takes all 16 at once and none is preempted; the padded batch's
    admission (16 x the longest) could not."""
    m = model("builtin:tiny")
    prompts, _ = _long_and_short(0)
    tokens = 8
    summed = sum(len(p) + tokens for p in prompts)
    budget = int(1.5 * summed * measure_kv(m).per_token)
    batch, kv = paged_batch(m, budget)
    bound = lambda n: None  # noqa: E731 - no prefix cache
    for i, p in enumerate(prompts):
        assert kv.reserve(i, len(p) + tokens, bound), f"row {i} did not fit"
    padded = KvBudget(budget, kv.layout, 64)
    assert not all(padded.reserve(i, len(p) + tokens, bound) for i, p in enumerate(prompts))

    rows = [Row(tuple(p), 0, tokens, frozenset(), make_request_sampler(GREEDY))
            for p in prompts]
    # The long row first, the short ones joining it once it decodes (as they would arrive;
    # joining while it still prefills, mlx-lm would right-pad them to its next chunk).
    uids = [u for u, _ in batch.insert(rows[:1])]
    counts = {uids[0]: _until_it_decodes(batch)}
    uids += [u for u, _ in batch.insert(rows[1:])]
    counts.update({u: 0 for u in uids[1:]})
    together = 0
    while not batch.empty:
        responses = batch.step()
        together = max(together, len(responses))
        for r in responses:
            counts[r.uid] += 1
            if r.finish_reason is not None:
                batch.finish([Done(r.uid, keep=False)])
    assert together == ROWS  # every row decoded in the same steps
    assert all(n == tokens for n in counts.values())
    assert kv.preempted == 0


# Beside the KV and the gathered view: a decode step's own activations and logits (16 rows
# of a 128-wide model: well under this).
SLACK = 4 * 1024**2


def _decode_peak(m: nn.Module, batch: LocalBatch, prompts: list[list[int]], tokens: int) -> int:
    """MLX's peak over the weights while `prompts` decode, rows joining and leaving: all but
    the last two prefilled first, then those two join mid-stream; short rows leave early.
    The prefill's own activations are not the KV's: the peak is reset once it is done."""
    mx.eval(m.parameters())
    mx.clear_cache()
    idle = mx.get_active_memory()
    rows = [Row(tuple(p), 0, tokens if i % 3 else tokens // 2, frozenset(),
                make_request_sampler(GREEDY)) for i, p in enumerate(prompts)]
    batch.insert(rows[:1])
    _until_it_decodes(batch)
    batch.insert(rows[1:-2])
    batch.step()
    mx.clear_cache()
    mx.reset_peak_memory()
    steps = 0
    while not batch.empty:
        if steps == 2:
            batch.insert(rows[-2:])  # short prompts: their prefill is small
        for r in batch.step():
            if r.finish_reason is not None:
                batch.finish([Done(r.uid, keep=False)])
        steps += 1
    return mx.get_peak_memory() - idle


def test_peak_memory_stays_within_budget_plus_reserve() -> None:
    """MLX's own peak, not the engine's projection: decoding a 4k-token row among 15 short
    ones, rows joining and leaving, the paged batch stays within its budget plus the view
    it gathers (rows x longest, one layer) and a decode step's activations; the padded
    batch of the same rows passes that (it holds 16 x the longest)."""
    m = model("builtin:tiny")
    prompts, _ = _long_and_short(0)
    prompts = [prompts[0][:4096]] + prompts[1:]
    tokens = 12
    budget = int(1.5 * sum(len(p) + tokens for p in prompts) * measure_kv(m).per_token)
    paged, kv = paged_batch(m, budget)
    assert kv.paging is not None
    view = ROWS * (4096 + tokens) * kv.paging.gather_per_token
    paged_peak = _decode_peak(m, paged, prompts, tokens)
    padded_peak = _decode_peak(m, LocalBatch(m, EngineConfig(prompt_cache_bytes=0)), prompts,
                               tokens)
    print(f"decode peak over the weights: paged {paged_peak}, padded {padded_peak}; budget "
          f"{budget}, gathered view {view}")
    assert paged_peak <= budget + view + SLACK, (paged_peak, budget + view + SLACK)
    assert padded_peak > budget + view + SLACK, (padded_peak, budget + view + SLACK)


def test_prefix_hits_and_boundaries_on_the_paged_batch() -> None:
    """With the prefix cache on: a conversation's second turn is served from its first
    turn's KV (its blocks, shared: `test_paged_prefix.py`) and its message boundary's KV is kept; the
    text is mlx-lm's for the whole prompt, token for token."""
    m = model("builtin:tiny")
    batch = LocalBatch(m, EngineConfig(prompt_cache_bytes=16 * 1024**2, paged_kv="on"))
    kv = KvBudget(64 * 1024**2, measure_kv(m), 64)
    batch.page(kv, 32768)
    assert kv.paging is not None and batch.cache is not None
    first = [prompt(i) for i in range(4)]

    def generate(prompts: list[list[int]], boundaries: list[int]) -> tuple[list[list[int]],
                                                                           list[int]]:
        rows = [Row(tuple(p), b, 10, frozenset(), make_request_sampler(GREEDY))
                for p, b in zip(prompts, boundaries)]
        served = batch.insert(rows)
        out: dict[int, list[int]] = {u: [] for u, _ in served}
        while not batch.empty:
            for r in batch.step():
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    batch.finish([Done(r.uid, keep=True)])
        return [out[u] for u, _ in served], [n for _, n in served]

    answers, _ = generate(first, [0] * 4)
    second = [p + a + [(5 * i + 9) % 500 + 3 for i in range(7)] for p, a in zip(first, answers)]
    got, served = generate(second, [len(p) + len(a) for p, a in zip(first, answers)])
    assert all(n > 0 for n in served), served  # every second turn hit its first's KV
    gen = BatchGenerator(m, completion_batch_size=32, prefill_batch_size=8)
    uids = gen.insert(second, max_tokens=[10] * len(second))
    want: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(v) < 10 for v in want.values()):
        for r in gen.next()[1]:
            want[r.uid].append(r.token)
    assert got == [want[u] for u in uids]
    assert kv.blocks is not None and kv.blocks().used == kv.blocks().shared  # the cache's
    batch.cache.evict_to(0)
    assert kv.blocks().used == 0
