"""`yes_no_scores` on mlx-lm's own qwen3 class, with a tied head (as Qwen3-Reranker-0.6B's)
and an untied one: rows of different lengths in one right-padded forward score as mlx-lm's
model call on each row alone does."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3

from replicas.rerank_scores import yes_no_scores

YES, NO = 7, 11
ROWS = [[3, 4, 5, 6, 7, 8, 9, 10, 1, 2], [3, 4], [12, 13, 14, 15, 16, 17], [20]]


def model(tied: bool) -> qwen3.Model:
    mx.random.seed(3)
    args = qwen3.ModelArgs.from_dict({
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 32, "max_position_embeddings": 128,
        "rope_theta": 10000.0, "tie_word_embeddings": tied})
    return qwen3.Model(args)


@pytest.mark.parametrize("tied", [True, False])
def test_batched_rows_score_as_the_model_call_alone(tied: bool) -> None:
    m = model(tied)
    assert hasattr(m, "lm_head") is not tied  # mlx-lm drops the head where it is tied
    got = yes_no_scores(m, ROWS, YES, NO, pad=0)
    want = []
    for row in ROWS:
        logits = m(mx.array([row]))[0, -1].astype(mx.float32)
        want.append(mx.softmax(mx.stack([logits[NO], logits[YES]]))[1].item())
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
    assert len({round(s, 5) for s in got}) == len(ROWS)
