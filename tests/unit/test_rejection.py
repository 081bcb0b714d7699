"""The q/p rule (`replicas.engine.sampling.rejection`) and the samplers' shape (`SamplingShape`).

Over 40,000 trials of two sampled drafts each, on a 6-token vocabulary, the first two
tokens emitted follow the target's p exactly (within 3x the sampling noise in total
variation), whatever q drafted them; drafts are kept as often as the rule says
(sum of min(p, q)); a draft that agrees with the target (q = p) is always kept.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from replicas.contract import SamplingParams
from replicas.engine.sampling.rejection import judge, verdict
from replicas.engine.sampling.samplers import SamplingShape, make_request_sampler

TRIALS, VOCAB = 40_000, 6


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _dist(seed: int) -> mx.array:
    """A log distribution with one token impossible (as top-k or a mask makes it)."""
    logits = mx.random.normal((VOCAB,), key=mx.random.key(seed)) * 0.6
    return _log_softmax(logits.at[seed % VOCAB].add(-mx.inf))


def _noise(p: mx.array, n: int) -> float:
    return 0.5 * math.sqrt(2 / math.pi) * mx.sqrt(p * (1 - p) / n).sum().item()


def _run(p: mx.array, q: mx.array) -> tuple[list[int], list[int], float]:
    """TRIALS passes of two drafts sampled from q (2, V) against p (3, V) (the target's
    next distributions, independent of the tokens here): the first and second tokens each
    emits (a pass that keeps nothing emits its second token on the next pass, drawn from
    p[1]), and the share of drafts kept."""
    mx.random.seed(3)
    drafts = mx.random.categorical(mx.broadcast_to(q, (TRIALS, 2, VOCAB)))
    keep, fix = judge(mx.broadcast_to(p[:2], (TRIALS, 2, VOCAB)),
                      mx.broadcast_to(q, (TRIALS, 2, VOCAB)), drafts)
    final = mx.random.categorical(mx.broadcast_to(p[2], (TRIALS, VOCAB)))
    later = mx.random.categorical(mx.broadcast_to(p[1], (TRIALS, VOCAB)))
    firsts, seconds, kept_total = [], [], 0
    for d, k, f, fin, nxt in zip(drafts.tolist(), keep.tolist(), fix.tolist(),
                                 final.tolist(), later.tolist()):
        kept, token = verdict(k, f, fin)
        kept_total += kept
        emitted = d[:kept] + [token]
        firsts.append(emitted[0])
        seconds.append(emitted[1] if len(emitted) > 1 else nxt)
    return firsts, seconds, kept_total / (2 * TRIALS)


def _distance(samples: list[int], p: mx.array) -> float:
    histogram = mx.zeros(VOCAB).at[mx.array(samples)].add(1.0) / len(samples)
    return 0.5 * mx.abs(histogram - p).sum().item()


def test_emitted_tokens_follow_the_target_whatever_drafted_them() -> None:
    p = mx.stack([_dist(1), _dist(2), _dist(3)])
    q = mx.stack([_dist(4), _dist(5)])
    firsts, seconds, share = _run(p, q)
    for samples, target in ((firsts, mx.exp(p[0])), (seconds, mx.exp(p[1]))):
        assert _distance(samples, target) < 3 * _noise(target, TRIALS)
    # The first draft is kept with probability sum(min(p, q)); the second only after it.
    first = mx.minimum(mx.exp(p[0]), mx.exp(q[0])).sum().item()
    second = mx.minimum(mx.exp(p[1]), mx.exp(q[1])).sum().item()
    expected = (first + first * second) / 2
    assert abs(share - expected) < 0.01, (share, expected)
    assert 0.2 < share < 0.8  # both kept and rejected drafts were exercised


def test_a_draft_that_agrees_with_the_target_is_always_kept() -> None:
    p = mx.stack([_dist(1), _dist(2), _dist(3)])
    firsts, _, share = _run(p, p[:2])
    assert share == 1.0
    assert _distance(firsts, mx.exp(p[0])) < 3 * _noise(mx.exp(p[0]), TRIALS)


def test_the_shared_sampler_draws_what_mlx_lms_sampler_draws() -> None:
    """The q/p rule's p is the shape's distribution; the sampler that draws the row's
    tokens must be that distribution, as mlx-lm's `make_sampler` would draw it."""
    params = SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, top_k=4)
    logprobs = _log_softmax(mx.random.normal((3, 50), key=mx.random.key(0)))
    ours, theirs = make_request_sampler(params), make_sampler(
        temp=0.7, top_p=0.8, min_p=0.05, top_k=4)
    mx.random.seed(9)
    a = ours(logprobs)
    mx.random.seed(9)
    assert mx.array_equal(a, theirs(logprobs))
    shape = SamplingShape.of(params)
    assert getattr(ours, "shape") == shape
    dist = mx.exp(shape.logprobs(logprobs))
    assert mx.allclose(dist.sum(axis=-1), mx.ones(3))
    assert (dist > 0).sum(axis=-1).max().item() <= 4  # top-k 4 leaves at most 4 tokens
