"""The pooling of `/v1/embeddings` (`replicas.engine.model.embedding`) against a reference
computed directly with mlx: each input alone through the model's body, no padding, pooled
by hand. Batched (right-padded, unequal lengths) must equal it within TOLERANCE, for both
poolings, with and without normalization, truncated or not, on two mlx-lm families."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, qwen3

from replicas.engine.model.embedding import (
    POOLINGS,
    Pooling,
    PoolingSpec,
    embed_rows,
    plan_batches,
)

# Max abs difference between a batched vector and its reference (float32; the batch only
# changes the order of sums), and the cosine distance allowed between them.
TOLERANCE = 1e-4
COSINE_TOLERANCE = 1e-4

ROWS = [[5, 17, 3], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7, 7, 7, 7], [2, 3]]


def _qwen3() -> nn.Module:
    return qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=64, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=True))


def _llama() -> nn.Module:
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=64,
        rope_theta=10000.0, tie_word_embeddings=True))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request: pytest.FixtureRequest) -> nn.Module:
    mx.random.seed(7)
    net = _qwen3() if request.param == "qwen3" else _llama()
    mx.eval(net.parameters())
    return net


def reference(model: nn.Module, row: list[int], pooling: Pooling, normalize: bool,
              dimensions: int | None = None) -> mx.array:
    """One input alone, no padding: the body's hidden states, pooled by hand."""
    hidden = model.model(mx.array([row]))[0].astype(mx.float32)  # (tokens, hidden)
    vector = {"last_token": hidden[-1], "cls": hidden[0]}.get(pooling, hidden.mean(axis=0))
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize or dimensions is not None:
        vector = vector / mx.linalg.norm(vector)
    return vector


def _close(got: list[float], want: mx.array) -> None:
    vector = mx.array(got)
    assert vector.shape == want.shape
    assert mx.max(mx.abs(vector - want)).item() <= TOLERANCE
    cosine = (vector @ want / (mx.linalg.norm(vector) * mx.linalg.norm(want))).item()
    assert cosine >= 1 - COSINE_TOLERANCE


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("normalize", [True, False])
def test_a_padded_batch_equals_each_input_alone(model: nn.Module, pooling: Pooling,
                                                normalize: bool) -> None:
    vectors = embed_rows(model, ROWS, PoolingSpec(pooling, normalize))
    assert len(vectors) == len(ROWS)
    for row, vector in zip(ROWS, vectors):
        _close(vector, reference(model, row, pooling, normalize))
        if normalize:
            assert abs(float(mx.linalg.norm(mx.array(vector)).item()) - 1) < 1e-5


@pytest.mark.parametrize("pooling", POOLINGS)
def test_the_same_text_alone_and_in_a_batch(model: nn.Module, pooling: Pooling) -> None:
    spec = PoolingSpec(pooling, True)
    (alone,) = embed_rows(model, [ROWS[0]], spec)
    batched = embed_rows(model, ROWS, spec)[0]
    _close(batched, mx.array(alone))


# Not `cls`: a causal model's first token sees nothing after it, padding or real.
@pytest.mark.parametrize("pooling", ["last_token", "mean"])
def test_pooling_reads_no_pad(model: nn.Module, pooling: Pooling) -> None:
    # Padding with the id the pads use (0) must not matter: a row that really ends in 0s
    # is another input, with another vector.
    spec = PoolingSpec(pooling, True)
    short, long = embed_rows(model, [[5, 17, 3], [5, 17, 3, 0, 0, 0, 0, 0, 0, 0, 0]], spec)
    _close(short, reference(model, [5, 17, 3], pooling, True))
    assert mx.max(mx.abs(mx.array(short) - mx.array(long))).item() > 1e-3


@pytest.mark.parametrize("pooling", POOLINGS)
def test_matryoshka_truncation_renormalizes(model: nn.Module, pooling: Pooling) -> None:
    vectors = embed_rows(model, ROWS, PoolingSpec(pooling, False), dimensions=16)
    for row, vector in zip(ROWS, vectors):
        assert len(vector) == 16
        _close(vector, reference(model, row, pooling, False, dimensions=16))


def test_plan_batches_bounds_rows_and_bytes_and_sorts_by_length() -> None:
    lengths = [10, 3, 7, 100, 3, 8]
    # Each group: at most 2 rows, and rows x longest x 4 bytes <= 100.
    batches = plan_batches(lengths, bytes_per_token=4, max_rows=2, max_bytes=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 2
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) * 4 <= 100
    assert batches[0] == [1, 4]  # the two shortest first
    assert [3] in batches  # past the bound alone: still a forward of its own


def test_plan_batches_fills_a_batch_when_it_fits() -> None:
    assert plan_batches([5] * 64, bytes_per_token=4) == [list(range(64))]
    assert [len(b) for b in plan_batches([5] * 130, bytes_per_token=4)] == [64, 64, 2]
