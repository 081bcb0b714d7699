"""The KV budget arithmetic (`replicas.engine.kv.budget`) on the machines and models a cluster is
for: the worked examples of docs/architecture.md ("KV memory"), to the byte; the tightest
rank; admission by what mlx-lm's padded batch cache holds; and layouts of every kind."""

from __future__ import annotations

from collections import deque

import pytest

from replicas.engine.kv.layout import CACHE_STEP, UNBOUNDED, KvLayout
from replicas.engine.kv.budget import KvBudget, Machine, RankMemory, default_budget, tightest

GIB = 1024**3
# Llama 3.3 70B: 80 layers, 8 KV heads of 128, bfloat16. Qwen3-235B-A22B: 94 layers, 4 KV
# heads of 128.
LLAMA_70B_PER_TOKEN = 80 * 8 * 128 * 2 * 2
QWEN3_235B_PER_TOKEN = 94 * 4 * 128 * 2 * 2


@pytest.mark.parametrize(
    ("working_set", "weights", "per_token", "budget", "tokens"),
    [
        # 64 GB Mac: macOS recommends a 48 GiB working set; 70B 4-bit weights take 37 GiB.
        (48 * GIB, 37 * GIB, LLAMA_70B_PER_TOKEN, 9_234_179_687, 28_160),
        # 192 GB Mac Studio: 144 GiB working set; Qwen3-235B 4-bit weights take 123 GiB.
        (144 * GIB, 123 * GIB, QWEN3_235B_PER_TOKEN, 14_817_637_172, 76_800),
    ],
    ids=["64GB-llama-70b", "192GB-qwen3-235b"],
)
def test_the_worked_examples(working_set: int, weights: int, per_token: int, budget: int,
                             tokens: int) -> None:
    got = default_budget(Machine(working_set, gpu_working_set=True), weights)
    assert got == budget
    assert got > 0
    # The old arithmetic (75% of the working set again, less the weights) gave nothing.
    assert int(working_set * 0.75) - weights <= 0
    assert KvBudget(got, KvLayout(per_token), 64).max_tokens == tokens


def test_ram_is_discounted_once_where_there_is_no_working_set() -> None:
    # 24 GiB of RAM: 18 GiB usable, a 0.9 GiB reserve, 1 GiB of weights.
    assert default_budget(Machine(24 * GIB, gpu_working_set=False), GIB) == \
        int(24 * GIB * 0.75) - GIB - int(24 * GIB * 0.75 * 0.05)


def test_layouts_of_every_kind() -> None:
    sliding = KvLayout(per_token=100, windows=((64, 50),), per_sequence=1000)
    assert sliding.bytes_for(10) == 1000 + 1000 + 500
    assert sliding.bytes_for(1000) == 1000 + 100_000 + 64 * 50
    assert sliding.tokens_within(sliding.bytes_for(1000)) == 1000
    assert sliding.tokens_within(sliding.bytes_for(1000) - 1) == 999
    assert sliding.tokens_within(999) == 0  # not even the fixed state
    # A model whose cache never grows past its windows: only the context caps it.
    assert KvLayout(per_token=0, windows=((128, 10),), per_sequence=5).tokens_within(10**6) \
        == UNBOUNDED


def test_the_tightest_rank_bounds_the_replica() -> None:
    layout = KvLayout(per_token=1000)
    small = RankMemory(budget=4_000_000, layout=layout, weights=0)
    large = RankMemory(budget=9_000_000, layout=layout, weights=0)
    assert tightest((large, small), 4096) == 4_000_000
    # A pipeline stage holding twice the layers per token fills its budget twice as fast.
    heavy = RankMemory(budget=9_000_000, layout=KvLayout(per_token=2000), weights=0)
    assert tightest((large, heavy), 4096) == 4_500_000


def test_admission_counts_the_padded_batch() -> None:
    kv = KvBudget(budget_bytes=4 * CACHE_STEP * 10, layout=KvLayout(per_token=10),
                  max_waiting=8)
    bounds: list[int] = []
    # Three rows of one step fit, then one that needs two steps: every row pads to it.
    for key in "abc":
        assert kv.reserve(key, 100, bounds.append)
    assert not kv.reserve("d", CACHE_STEP + 1, bounds.append)
    assert kv.reserve("d", 10, bounds.append)  # a fourth row of one step fits
    assert kv.projected == 4 * CACHE_STEP * 10
    assert not kv.reserve("a", CACHE_STEP + 1, bounds.append)  # a cannot grow now
    kv.release("d")
    kv.release("c")
    assert kv.reserve("a", CACHE_STEP + 1, bounds.append)  # two rows of two steps
    # Before each reservation the prefix cache is bound to what the rows leave; a failed
    # reservation tells it nothing, and neither does an unchanged room ("a" growing).
    step = CACHE_STEP * 10  # one row of one step
    assert bounds == [3 * step, 2 * step, step, 0]
    kv.release("b")
    kv.fit_cache(bounds.append)  # a release leaves room the cache may grow back into
    assert bounds == [3 * step, 2 * step, step, 0, 2 * step]  # "a": one row of two steps
    kv.fit_cache(bounds.append)
    assert len(bounds) == 5


def test_take_keeps_order_and_never_refuses_what_it_must_keep() -> None:
    kv = KvBudget(budget_bytes=CACHE_STEP * 10, layout=KvLayout(per_token=10), max_waiting=1)
    admitted, waiting, refused = kv.take(
        ["kept", "x", "y", "z"], lambda i: i, lambda i: 100 if i != "kept" else 300,
        lambda n: None, keep=lambda i: i == "kept")
    # "kept" needs two steps and waits; first come first served holds the rest behind it.
    assert admitted == [] and waiting == deque(["kept"]) and refused == ["z", "y", "x"]
