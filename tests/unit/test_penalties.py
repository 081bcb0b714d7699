"""Bias and penalties for a whole batch (`replicas.engine.sampling.penalties`) equal mlx-lm's own
per-row processors (`make_logits_processors`), value for value."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from replicas.contract import SamplingParams
from replicas.engine.sampling.penalties import PENALTY_CONTEXT, Penalties, apply, window

VOCAB = 97


def mlx_lm_row(logits: mx.array, penalties: Penalties | None, tokens: list[int]) -> mx.array:
    if penalties is None:
        return logits
    processors = make_logits_processors(
        logit_bias=dict(penalties.bias) or None,
        repetition_penalty=penalties.repetition if penalties.repetition != 1.0 else None,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=penalties.presence or None, presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=penalties.frequency or None, frequency_context_size=PENALTY_CONTEXT)
    for processor in processors:
        logits = processor(mx.array(tokens), logits)
    return logits


ROWS = [
    Penalties(((3, 2.0), (7, -1.5)), 1.3, 0.4, 0.2),
    None,
    Penalties((), 1.0, 0.0, 0.5),
    Penalties(((1, 5.0),), 1.0, 0.0, 0.0),
    Penalties((), 0.7, 0.0, 0.0),
    Penalties((), 1.0, -0.3, 0.0),
]


@pytest.mark.parametrize("seed", range(3))
def test_the_batch_equals_mlx_lms_processors_row_by_row(seed: int) -> None:
    rng = random.Random(seed)
    mx.random.seed(seed)
    # Contexts shorter and longer than the window, and with repeats (frequency counts them).
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.choice([1, 5, 300, 600]))]
                for _ in ROWS]
    logits = mx.random.normal((len(ROWS), VOCAB)) * 4
    batched = apply(logits, ROWS, contexts)
    # The same with each row's newest token still an array (the pipelined step's form).
    lazy = apply(logits, ROWS, window([c[:-1] for c in contexts],
                                      mx.array([c[-1] for c in contexts])))
    for i, (row, context) in enumerate(zip(ROWS, contexts)):
        expected = mlx_lm_row(logits[i:i + 1], row, context)
        assert mx.array_equal(batched[i:i + 1], expected), i
        assert mx.array_equal(lazy[i:i + 1], expected), i
        if row is not None:  # the per-row form, for mlx-lm's own first-token call
            assert mx.array_equal(row(mx.array(context), logits[i:i + 1]), expected), i


def test_bias_alone_needs_no_context_and_no_rows_change_nothing() -> None:
    logits = mx.random.normal((2, VOCAB))
    out = apply(logits, [Penalties(((4, 1.0),)), None], None)
    assert out[0, 4].item() == pytest.approx(logits[0, 4].item() + 1.0)
    assert mx.array_equal(out[1], logits[1])
    assert apply(logits, [None, None], None) is logits


def test_a_request_without_any_has_none() -> None:
    assert Penalties.of(SamplingParams()) is None
    got = Penalties.of(SamplingParams(logit_bias={9: -100.0, 2: 1.0}, frequency_penalty=0.5))
    assert got == Penalties(((2, 1.0), (9, -100.0)), 1.0, 0.0, 0.5)
    assert got is not None and got.looks_back
    assert not Penalties(((1, 1.0),)).looks_back
